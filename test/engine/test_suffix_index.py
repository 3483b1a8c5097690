"""The suffix drafter's index and history file, on scripted token sequences: longest match, counts,
sequence bounds, eviction, exact undo, and the file's round trip and refusals."""
from __future__ import annotations

import doctest
import os
import random
import tracemalloc
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import pytest

from gemma_spec_ros.engine.drafters import learned_cache, suffix_history, suffix_index
from gemma_spec_ros.engine.drafters.suffix_index import DEFAULT_LEVELS, SEPARATOR, SuffixIndex

TAG = "vocab-1-262144-" + "ab" * 20


def test_module_doctests() -> None:
    for module in (suffix_index, suffix_history):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0


def index_of(*sequences: Sequence[int], capacity: int = 256) -> SuffixIndex:
    index = SuffixIndex(capacity)
    for sequence in sequences:
        index.new_sequence()
        index.extend(sequence)
    return index


def brute_force_match(stream: Sequence[int], start: int, context: Sequence[int], limit: int,
                      levels: Sequence[int] = DEFAULT_LEVELS) -> Optional[Tuple[int, Tuple[int, ...]]]:
    """The longest level whose last n tokens of ``context`` occur in ``stream`` (every token ever
    appended, separators included: index = position) inside one sequence, ending at a live position
    (>= ``start``; its first tokens may be evicted) with a following token; the newest ``limit``
    end positions."""
    for n in reversed(levels):
        if n > len(context):
            continue
        key = list(context[-n:])
        found = [end for end in range(len(stream) - 2, max(start, n - 1) - 1, -1)
                 if stream[end - n + 1:end + 1] == key and stream[end + 1] != SEPARATOR]
        if found:
            return n, tuple(found[:limit])
    return None


def live_stream(index: SuffixIndex) -> List[int]:
    return [index.token(p) for p in range(index.start, index.end)]


# ------------------------------------------------------------------------------------- matching
def test_the_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    index = index_of([1, 2, 3, 4, 9], [7, 3, 4, 5], [8, 3, 4, 5], [2, 3, 4])
    match = index.longest_match([2, 3, 4], limit=8)
    assert match is not None and match.length == 3  # "2 3 4" once (-> 9), not "3 4" thrice
    assert [index.follower(p) for p in match.positions] == [9]
    shorter = index.longest_match([6, 3, 4], limit=8)
    assert shorter.length == 2 and [index.follower(p) for p in shorter.positions] == [5, 5, 9]


def test_occurrences_are_counted_newest_first_up_to_the_limit() -> None:
    index = index_of(*([5, 6, t] for t in range(10, 20)))
    assert [index.follower(p) for p in index.occurrences([5, 6], limit=4)] == [19, 18, 17, 16]
    assert len(index.occurrences([5, 6], limit=100)) == 10


def test_a_match_never_spans_two_sequences_and_a_continuation_never_runs_into_the_next() -> None:
    index = index_of([1, 2], [3, 4])
    assert index.longest_match([2, 3], limit=8).length == 1  # "2 3" only across the boundary
    assert index.occurrences([2], limit=8) == []  # 2 ends its sequence: nothing follows it
    assert [index.follower(p) for p in index.occurrences([3], limit=8)] == [4]


def test_the_context_itself_at_the_end_of_the_index_does_not_count() -> None:
    index = index_of([4, 5, 6, 4, 5])
    match = index.longest_match([4, 5, 6, 4, 5], limit=8)
    assert match.length == 2 and [index.follower(p) for p in match.positions] == [6]


def test_max_length_bounds_the_match() -> None:
    index = index_of(list(range(1, 40)) + [99], list(range(1, 40)))
    assert index.longest_match(list(range(1, 40)), limit=8).length == 32
    assert index.longest_match(list(range(1, 40)), limit=8, max_length=10).length == 8


@pytest.mark.parametrize("seed", range(6))
def test_matches_agree_with_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    index = SuffixIndex(capacity=400)
    stream: List[int] = []
    for _ in range(30):  # sequences over a small alphabet: many repeats, many boundaries
        sequence = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        if stream or index.end:
            stream.append(SEPARATOR)
        index.new_sequence()
        index.extend(sequence)
        stream.extend(sequence)
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        expected = brute_force_match(stream, index.start, context, limit=5)
        match = index.longest_match(context, limit=5)
        assert (None if match is None else (match.length, match.positions)) == expected
    assert live_stream(index) == stream[len(stream) - len(index):]


# ------------------------------------------------------------------------------------- eviction
def test_a_full_ring_evicts_the_oldest_tokens_and_never_returns_them() -> None:
    index = SuffixIndex(capacity=16)
    index.extend([1, 2, 3])
    index.new_sequence()
    index.extend(range(10, 30))  # 3 + 1 + 20 > 16: the first sequence is gone
    assert len(index) == 16 and index.start == index.end - 16
    assert index.occurrences([1], limit=8) == [] and index.occurrences([2], limit=8) == []
    assert index.sequences() == [list(range(14, 30))]
    assert [index.follower(p) for p in index.occurrences([20], limit=8)] == [21]


def test_evict_to_keeps_the_newest_slots() -> None:
    index = index_of([1, 2, 3], [1, 2, 4], [1, 2, 5])
    index.evict_to(5)  # "4", the separator, "1 2 5"
    assert len(index) == 5
    assert [index.follower(p) for p in index.occurrences([1], limit=8)] == [2]
    assert index.sequences() == [[4], [1, 2, 5]]


# ------------------------------------------------------------------------------------- truncate
@pytest.mark.parametrize("seed", range(4))
def test_truncate_undoes_appends_exactly(seed: int) -> None:
    rng = random.Random(100 + seed)
    history = [[rng.randrange(5) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    index = index_of(*history, capacity=512)
    fresh = index_of(*history, capacity=512)
    keep = index.end
    index.new_sequence()
    index.extend(rng.randrange(5) for _ in range(50))
    index.truncate(index.end - 20)
    index.truncate(keep)
    assert live_stream(index) == live_stream(fresh)
    for level in range(len(DEFAULT_LEVELS)):  # the chains are the same arrays again
        assert index._heads[level] == fresh._heads[level]
    for _ in range(50):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 35))]
        assert index.longest_match(context, 6) == fresh.longest_match(context, 6)
    index.extend([1, 2])  # and it goes on from there like the fresh one
    fresh.extend([1, 2])
    assert index.longest_match([1, 2], 6) == fresh.longest_match([1, 2], 6)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SuffixIndex(0)
    with pytest.raises(ValueError, match="levels"):
        SuffixIndex(8, levels=(2, 1))
    index = index_of([1, 2, 3])
    with pytest.raises(ValueError, match="must be >= 0"):
        index.extend([-1])
    with pytest.raises(ValueError, match="outside"):
        index.truncate(index.end + 1)


# -------------------------------------------------------------------------------- history file
def test_the_history_file_round_trips_and_keeps_the_newest_tokens(tmp_path: Path) -> None:
    path = tmp_path / "history.bin"
    sequences = [[1, 2, 3], [262143, 0], [4, 5, 6, 7]]
    suffix_history.save(sequences, path, TAG)
    assert suffix_history.load(path, TAG) == sequences
    assert suffix_history.load(path, TAG, max_tokens=5) == [[0], [4, 5, 6, 7]]
    assert suffix_history.load(tmp_path / "absent.bin", TAG) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "header"])
def test_a_damaged_history_file_is_told_from_a_good_one(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "history.bin"
    suffix_history.save([[1, 2, 3], [4, 5]], path, TAG)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        del data[-4:]
    elif damage == "append":
        data += b"\0\0\0\0"
    else:
        data[8] = 99  # format version
    path.write_bytes(bytes(data))
    with pytest.raises(learned_cache.CorruptLearnedCacheError, match="suffix history"):
        suffix_history.load(path, TAG)


def test_a_foreign_file_is_refused_and_never_overwritten(tmp_path: Path) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"the robot's notes\n")
    learned = tmp_path / "learned.bin"
    learned_cache.save(learned_cache.NgramCache(), learned, TAG)  # ours, but another format
    for path in (victim, learned):
        before = path.read_bytes()
        with pytest.raises(learned_cache.ForeignFileError, match="not a suffix history"):
            suffix_history.load(path, TAG)
        with pytest.raises(learned_cache.ForeignFileError, match="refusing to overwrite"):
            suffix_history.save([[1]], path, TAG)
        with pytest.raises(learned_cache.ForeignFileError):
            suffix_history.check_loadable(path)
        assert path.read_bytes() == before


def test_a_history_of_another_vocabulary_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "history.bin"
    suffix_history.save([[1, 2]], path, TAG)
    with pytest.raises(learned_cache.VocabularyMismatchError, match="another vocabulary"):
        suffix_history.load(path, "vocab-1-49152-" + "cd" * 20)


def test_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "history.bin"
    os.mkfifo(fifo)
    with pytest.raises(learned_cache.ForeignFileError):
        suffix_history.check_loadable(fifo)
    with pytest.raises(learned_cache.CacheFormatError):
        suffix_history.load(fifo, TAG)


def test_a_history_with_token_ids_outside_the_vocabulary_is_damaged(tmp_path: Path) -> None:
    """Q7: a history with a valid header and checksum whose ids lie past the vocabulary its tag
    names loaded, and every request whose context matched failed in llama_decode (the drafter
    drafted a token the target cannot decode: llama.cpp refuses the whole batch)."""
    path = tmp_path / "history.bin"
    suffix_history.save([[1, 2, 3], [5, 6, 7, 262149, 2147483647]], path, TAG)  # TAG: 262144 tokens
    for max_tokens in (None, 4, 1):  # a bad id in the part cut off too: the file is damaged
        with pytest.raises(learned_cache.CorruptLearnedCacheError,
                           match="suffix history .*outside the vocabulary of 262144 tokens") as error:
            suffix_history.load(path, TAG, max_tokens)
        assert "262149" not in str(error.value) and "2147483647" not in str(error.value)
    suffix_history.save([[1, 2, 3], [5, 6, 262143]], path, TAG)  # the last id of the vocabulary
    assert suffix_history.load(path, TAG) == [[1, 2, 3], [5, 6, 262143]]
    with pytest.raises(learned_cache.CorruptLearnedCacheError, match="vocabulary of 200 tokens"):
        suffix_history.load(path, TAG, n_vocab=200)  # a size given apart from the tag's
    suffix_history.save([[5, 6, 262149]], path, "vocab-x")  # a tag naming no size: no bound
    assert suffix_history.load(path, "vocab-x") == [[5, 6, 262149]]


def test_loading_makes_python_ints_of_the_kept_tokens_only() -> None:
    """Decoding turned every token of the file into a Python int (~36 bytes each) before the newest
    ``history_max_tokens`` were kept: a 64 MiB history of a larger bound cost ~0.6 GiB to keep
    a few tokens."""
    tokens = list(range(1000, 251_000)) * 2  # ids past the small-int cache: each a new object
    data = suffix_history.encode([tokens[:250_000], tokens[250_000:]], TAG)
    tracemalloc.start()
    try:
        kept = suffix_history.decode(data, "<bytes>", TAG, max_tokens=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert kept == [tokens[-10:]]
    assert peak < 2_000_000, f"{peak} bytes at the peak for 10 kept tokens of {len(tokens)}"
