"""NgramCache: llama.cpp-compatible n-gram counts, their file format and its failure modes."""
from __future__ import annotations

import doctest
import os
import random
import struct
import subprocess
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.drafters import ngram_cache as ngram_cache_module
from gemma_spec_ros.engine.drafters.ngram_cache import NGRAM_MAX, CacheFileNotFoundError, NgramCache
from gemma_spec_ros.engine.errors import CacheFormatError
from gemma_spec_ros.tools import lookup_create

Counts = Dict[Tuple[int, ...], Dict[int, int]]


def reference_counts(tokens: Sequence[int], ngram_min: int, ngram_max: int) -> Counts:
    """What llama.cpp's common_ngram_cache_update counts, written the obvious way."""
    counters: Dict[Tuple[int, ...], Counter] = {}
    for size in range(ngram_min, ngram_max + 1):
        for end in range(size, len(tokens)):
            counters.setdefault(tuple(tokens[end - size:end]), Counter())[tokens[end]] += 1
    return {ngram: dict(counter) for ngram, counter in counters.items()}


def as_counts(cache: NgramCache) -> Counts:
    return {ngram: dict(part) for ngram, part in cache.items()}


def record(ngram: Sequence[int], continuations: Sequence[Tuple[int, int]]) -> bytes:
    """One record of llama.cpp's file, built by hand from the format description."""
    padded = list(ngram) + [-1] * (NGRAM_MAX - len(ngram))
    pairs = [value for pair in continuations for value in pair]
    return struct.pack(f"<{NGRAM_MAX + 1 + len(pairs)}i", *padded, len(continuations), *pairs)


def random_tokens(seed: int, length: int, vocab: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def test_module_doctests() -> None:
    result = doctest.testmod(ngram_cache_module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("ngram_min,ngram_max", [(1, 4), (2, 2), (1, 1), (3, 4)])
def test_update_counts_every_ngram_and_its_follower(ngram_min: int, ngram_max: int) -> None:
    tokens = random_tokens(seed=ngram_max, length=400, vocab=7)
    cache = NgramCache()
    cache.update(tokens, ngram_min, ngram_max)
    assert as_counts(cache) == reference_counts(tokens, ngram_min, ngram_max)


def test_incremental_and_chunked_updates_equal_one_update() -> None:
    tokens = random_tokens(seed=1, length=300, vocab=5)
    one_shot, incremental, chunked = NgramCache(), NgramCache(), NgramCache()
    one_shot.update(tokens, 1, 4)
    for length in range(0, len(tokens) + 1, 7):  # the context grows by appending
        incremental.update(tokens[:length], 1, 4, start_index=max(0, length - 7))
    incremental.update(tokens, 1, 4, start_index=len(tokens) // 7 * 7)
    for start in range(0, len(tokens), 64):
        chunked.update(tokens, 1, 4, start_index=start, stop_index=start + 64)
    assert incremental == one_shot
    assert chunked == one_shot


def test_update_accepts_numpy_tokens_and_stores_python_ints() -> None:
    numpy = pytest.importorskip("numpy")
    cache = NgramCache()
    cache.update(numpy.array([3, 4, 3, 4], dtype=numpy.int32), 2, 2)
    ((ngram, part),) = [(n, p) for n, p in cache.items() if n == (3, 4)]
    assert all(type(t) is int for t in ngram + tuple(part))


@pytest.mark.parametrize("ngram_min,ngram_max", [(0, 2), (2, 1), (1, 5)])
def test_update_rejects_bad_sizes(ngram_min: int, ngram_max: int) -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramCache().update([1, 2, 3], ngram_min, ngram_max)


def test_get_ignores_padding_and_misses_return_none() -> None:
    cache = NgramCache()
    cache.update([10, 11, 12], 1, 2)
    assert cache.get([10, 11, -1, -1]) == {12: 1}
    assert cache.get((10, 11)) == {12: 1}
    assert (10, 11) in cache
    assert cache.get((12,)) is None


def test_merge_adds_counts() -> None:
    first, second = NgramCache(), NgramCache()
    first.update([1, 2, 1, 3], 1, 1)
    second.update([1, 2, 5, 6], 1, 1)
    first.merge(second)
    assert first.get((1,)) == {2: 2, 3: 1}
    assert first.get((5,)) == {6: 1}
    second.update([5, 7], 1, 1)  # the merged cache holds copies, not the other's dicts
    assert first.get((5,)) == {6: 1}


def test_file_round_trip(tmp_path: Path) -> None:
    cache = NgramCache()
    cache.update(random_tokens(seed=2, length=2000, vocab=50), 1, 4)
    path = tmp_path / "cache.bin"
    cache.save(path)
    expected_size = sum(4 * (NGRAM_MAX + 1 + 2 * len(part)) for _, part in cache.items())
    assert path.stat().st_size == expected_size
    assert NgramCache.load(path) == cache
    assert os.listdir(tmp_path) == ["cache.bin"]  # no temporary file left behind


def test_empty_cache_is_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    NgramCache().save(path)
    assert path.read_bytes() == b""
    assert len(NgramCache.load(path)) == 0


def test_reads_the_documented_layout() -> None:
    data = record([7, 8], [(9, 3), (4, 1)]) + record([5], [(6, 2)]) + record([1, 2, 3, 4], [(0, 1)])
    cache = NgramCache.from_bytes(data)
    assert as_counts(cache) == {(7, 8): {9: 3, 4: 1}, (5,): {6: 2}, (1, 2, 3, 4): {0: 1}}
    # and writes it back: same records, little-endian int32, -1 padding
    assert cache.to_bytes() == data


def test_save_replaces_an_existing_file_atomically(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    old = NgramCache()
    old.update([1, 2, 3], 1, 2)
    old.save(path)
    overflowing = NgramCache.from_bytes(record([1], [(2, 1)]))
    overflowing.get((1,))[2] = 2**32  # set by hand: update and merge stop at int32's maximum
    with pytest.raises(ValueError, match="int32"):
        overflowing.save(path)
    assert NgramCache.load(path) == old
    new = NgramCache()
    new.update([4, 5], 1, 1)
    new.save(path)
    assert NgramCache.load(path) == new
    assert sorted(os.listdir(tmp_path)) == ["cache.bin"]


def test_every_truncation_is_rejected_cleanly(tmp_path: Path) -> None:
    data = record([7, 8], [(9, 3), (4, 1)]) + record([5], [(6, 2)])
    record_ends = {len(record([7, 8], [(9, 3), (4, 1)])), len(data)}
    for length in range(1, len(data)):
        path = tmp_path / "truncated.bin"
        path.write_bytes(data[:length])
        if length in record_ends:  # a whole number of records is a valid, smaller cache
            assert NgramCache.load(path) == NgramCache.from_bytes(data[:length])
            assert NgramCache.load(path).get((7, 8)) == {9: 3, 4: 1}
            continue
        with pytest.raises(CacheFormatError, match="byte offset") as error:
            NgramCache.load(path)
        assert str(path) in str(error.value)


@pytest.mark.parametrize("data,problem,offset", [
    (record([1], [(2, 1)])[:-2], "past the end", 16),  # cut inside the last pair
    (struct.pack("<5i", 1, -1, -1, -1, 0), "continuation count below 1", 16),
    (struct.pack("<5i", 1, -1, -1, -1, -3), "continuation count below 1", 16),
    (struct.pack("<7i", 1, -1, -1, -1, 2**30, 5, 1), "past the end", 16),  # absurd size
    (struct.pack("<7i", -1, -1, -1, -1, 1, 5, 1), "invalid n-gram", 0),
    (struct.pack("<7i", 1, -1, 2, -1, 1, 5, 1), "invalid n-gram", 0),
    (record([1], [(2, 1), (3, 0)]), "invalid continuation", 28),
    (record([1], [(-5, 1)]), "invalid continuation", 20),
    (record([1], [(2, 1), (2, 4)]), "repeats", 20),
    (record([1], [(2, 1)]) + record([1], [(3, 1)]), "appears twice", 28),
    (record([1], [(2, 1)]) + b"\x01\x02", "record header truncated", 28),
], ids=lambda value: value if isinstance(value, str) else "")
def test_corrupt_files_name_the_problem_and_offset(data: bytes, problem: str, offset: int) -> None:
    with pytest.raises(CacheFormatError, match=problem) as error:
        NgramCache.from_bytes(data, source="corrupt.bin")
    assert "corrupt.bin: " in str(error.value)
    assert f"at byte offset {offset} " in str(error.value)


def test_a_refusal_never_quotes_the_file_s_content() -> None:
    """The reason lands on /diagnostics: a path a peer names must not leak bytes of that file
    (the old message quoted 'continuation count 2051945283', 4 bytes of an SSH key)."""
    secret = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOq secret@host\n"
    numbers = {str(v) for v in np.frombuffer(secret[:len(secret) // 4 * 4], dtype="<i4").tolist()}
    for data in (secret, struct.pack("<7i", 1, -1, -1, -1, 1, -977, 1), struct.pack("<5i", 1, 2, 3, 99, 0)):
        with pytest.raises(CacheFormatError) as error:
            NgramCache.from_bytes(data, source="victim")
        message = str(error.value)
        assert not any(number in message for number in numbers | {"-977", "99"}), message


def test_more_n_grams_than_the_bound_are_refused_before_building_the_table() -> None:
    data = b"".join(record([i], [(i + 1, 1)]) for i in range(50))
    assert len(NgramCache.from_bytes(data, max_ngrams=50)) == 50
    with pytest.raises(CacheFormatError, match="more than 49 n-grams"):
        NgramCache.from_bytes(data, source="big.bin", max_ngrams=49)


def test_missing_file_is_a_cache_error_and_a_file_not_found_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.bin"
    with pytest.raises(CacheFileNotFoundError, match="does not exist") as error:
        NgramCache.load(path)
    assert isinstance(error.value, CacheFormatError)
    assert isinstance(error.value, FileNotFoundError)
    assert str(path) in str(error.value)


def test_unreadable_path_is_a_cache_error(tmp_path: Path) -> None:
    with pytest.raises(CacheFormatError, match="cannot read"):
        NgramCache.load(tmp_path)  # a directory


# ------------------------------------------------------------------- gemma-spec-lookup-create
CORPUS = (
    "The robot picks up the red cube and places it on the table.\n"
    "The robot picks up the blue cube and places it on the shelf.\n"
    "The robot picks up the green cube and places it in the box.\n"
)


def write_corpus(directory: Path, text: str = CORPUS) -> Path:
    path = directory / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_lookup_create_writes_the_corpus_2grams(tmp_path: Path, embedded_model_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    output = tmp_path / "static.bin"
    assert lookup_create.main([str(corpus), "-o", str(output), "-m", str(embedded_model_path),
                               "-q"]) == 0
    # the tool drops one trailing newline, as llama.cpp's -f does
    (tokens,) = lookup_create.tokenize_texts(str(embedded_model_path), [CORPUS[:-1].encode()])
    assert tokens[0] == 2  # Gemma's BOS, added as llama.cpp's common_tokenize does
    cache = NgramCache.load(output)
    assert as_counts(cache) == reference_counts(tokens, 2, 2)
    assert all(len(ngram) == 2 for ngram in cache)
    the_robot = tokens[1:3]  # "The robot" starts each of the three lines, all followed by "picks"
    assert cache.get(the_robot) == {tokens[3]: 3}


def test_lookup_create_sums_several_files_without_joining_them(
        tmp_path: Path, embedded_model_path: Path) -> None:
    model = str(embedded_model_path)
    corpora = [tmp_path / "a.txt", tmp_path / "b.txt"]
    corpora[0].write_text("pick the cube")
    corpora[1].write_text("place the cube")
    expected = NgramCache()
    for corpus in corpora:
        single = tmp_path / f"{corpus.stem}.bin"
        assert lookup_create.main([str(corpus), "-o", str(single), "-m", model, "-q"]) == 0
        expected.merge(NgramCache.load(single))
    both = tmp_path / "both.bin"
    assert lookup_create.main([*map(str, corpora), "-o", str(both), "-m", model, "-q"]) == 0
    assert NgramCache.load(both) == expected


def test_lookup_create_reports_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture,
                                             embedded_model_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        lookup_create.main([str(tmp_path / "nope.txt"), "-o", str(tmp_path / "c.bin"),
                            "-m", str(embedded_model_path)])
    assert exit_info.value.code == 2
    assert "corpus file not found" in capsys.readouterr().err
    corpus = write_corpus(tmp_path)
    with pytest.raises(SystemExit):
        lookup_create.main([str(corpus), "-o", str(tmp_path / "c.bin"), "-m", "/no/model.gguf"])
    assert "model file not found" in capsys.readouterr().err
    assert lookup_create.main([str(corpus), "-o", str(tmp_path / "c.bin"), "-m", str(corpus),
                               "-q"]) == 1
    assert "cannot load the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "c.bin").exists()


# ------------------------------------------------- optional cross-check with llama.cpp's own tool
def native_tool(name: str) -> Path:
    """A binary built by scripts/build_native_tools.sh (in the cache dir of scripts/setup.sh)."""
    cache = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")
    return cache / "native" / "bin" / name


@pytest.mark.skipif(not native_tool("llama-lookup-create").is_file(),
                    reason=f"cross-check against llama.cpp skipped: {native_tool('llama-lookup-create')} is not "
                           "built (run `bash scripts/build_native_tools.sh`, ~7 min on 2 cores; "
                           ".ci/run builds it)")
def test_same_file_content_as_llama_lookup_create(tmp_path: Path,
                                                  embedded_model_path: Path) -> None:
    # Special-token text and a trailing newline exercise the tokenizer flags and llama.cpp's -f.
    corpus = write_corpus(tmp_path, CORPUS * 3 + "<start_of_turn>user\nthe robot stops ✓\n")
    native_file, our_file = tmp_path / "native.bin", tmp_path / "ours.bin"
    completed = subprocess.run(
        [str(native_tool("llama-lookup-create")), "-m", str(embedded_model_path),
         "-f", str(corpus), "-lcs", str(native_file), "-c", "512", "-t", "1", "-ngl", "0"],
        capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert lookup_create.main([str(corpus), "-o", str(our_file), "-m", str(embedded_model_path),
                               "-q"]) == 0
    native = NgramCache.load(native_file)  # our loader reads llama.cpp's file
    ours = NgramCache.load(our_file)
    assert len(native) > 20
    assert native == ours  # same n-grams, same counts (record order is llama.cpp's hash order)
    assert native_file.stat().st_size == our_file.stat().st_size


@pytest.mark.parametrize("data,offset", [
    (record([1], [(2, 1)]) + record([50, 3], [(4, 1)]), 28),  # in an n-gram
    (record([1], [(2, 1), (40, 1)]), 28),  # a continuation: n_vocab itself is outside
    (record([3, 39, 2147483647], [(1, 1)]), 0),
], ids=["ngram", "continuation", "int32-max"])
def test_token_ids_outside_the_vocabulary_are_refused_with_n_vocab(data: bytes, offset: int) -> None:
    """Q7: a cache of another model (llama-lookup-create run on another GGUF) loaded, and its drafts
    failed the target's whole batch in llama_decode. Its records are valid: only the vocabulary
    size tells them apart, and only the offset is named, never the id."""
    assert len(NgramCache.from_bytes(data)) > 0  # without a vocabulary: nothing to compare
    with pytest.raises(CacheFormatError, match="outside this model's vocabulary of 40 tokens") as error:
        NgramCache.from_bytes(data, source="other-model.lcd", n_vocab=40)
    message = str(error.value)
    assert "other-model.lcd: " in message and f"at byte offset {offset}:" in message
    assert not any(number in message for number in ("50", "2147483647")), message
    largest = max(np.frombuffer(data, dtype="<i4").tolist())
    if largest < 2**31 - 1:  # one more token in the vocabulary: the same file loads
        assert len(NgramCache.from_bytes(data, n_vocab=largest + 1)) > 0
