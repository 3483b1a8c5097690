"""LookupDrafter: n-gram drafts from the context, dynamic and static caches (llama.cpp rules)."""
from __future__ import annotations

import doctest
import os
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple, Union, overload

import pytest

from gemma_spec_ros.engine.drafters import learned_cache
from gemma_spec_ros.engine.drafters import lookup as lookup_module
from gemma_spec_ros.engine.drafters.lookup import (LAX_THRESHOLDS, STRICT_THRESHOLDS, DraftThresholds,
                                                   LookupDrafter, draft_tokens)
from gemma_spec_ros.engine.drafters.ngram_cache import NgramCache
from gemma_spec_ros.engine.stats import SpecStats
from gemma_spec_ros.engine.drafters.base import EMPTY_DRAFT, Draft
from gemma_spec_ros.engine.errors import CacheFormatError
from gemma_spec_ros.engine.config import LookupConfig
from gemma_spec_ros.tools import lookup_create

PATTERN = [11, 12, 13, 14, 15]


def cache_of(tokens: Sequence[int], ngram_min: int = 1, ngram_max: int = 4) -> NgramCache:
    cache = NgramCache()
    cache.update(tokens, ngram_min, ngram_max)
    return cache


def drafter(dynamic_path: str = "") -> LookupDrafter:
    """A drafter with an empty static cache and a dynamic cache at ``dynamic_path`` (if any)."""
    return LookupDrafter(LookupConfig(dynamic_path=dynamic_path))


def test_module_doctests() -> None:
    result = doctest.testmod(lookup_module)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------------- thresholds
@pytest.mark.parametrize("thresholds,size,count,sample_size,accepted", [
    (LAX_THRESHOLDS, 1, 1, 1, False),   # a 1-gram needs 2 observations
    (LAX_THRESHOLDS, 1, 2, 2, True),
    (LAX_THRESHOLDS, 1, 2, 3, True),    # 66.7 % >= 66 %
    (LAX_THRESHOLDS, 1, 1, 2, False),   # 50 % < 66 %
    (LAX_THRESHOLDS, 2, 1, 2, True),    # 50 % >= 50 %
    (LAX_THRESHOLDS, 2, 1, 1, False),
    (LAX_THRESHOLDS, 4, 1, 1, True),    # one sighting of a 4-gram is enough
    (LAX_THRESHOLDS, 4, 1, 3, False),
    (STRICT_THRESHOLDS, 1, 3, 3, False),  # 4 observations needed
    (STRICT_THRESHOLDS, 1, 3, 4, True),   # exactly 75 %
    (STRICT_THRESHOLDS, 1, 2, 3, False),
    (STRICT_THRESHOLDS, 2, 2, 3, True),   # 66.7 % >= 66 %
    (STRICT_THRESHOLDS, 4, 1, 1, False),
    (STRICT_THRESHOLDS, 4, 2, 2, True),
])
def test_thresholds_are_llama_cpps(thresholds: DraftThresholds, size: int, count: int,
                                   sample_size: int, accepted: bool) -> None:
    assert thresholds.accepts(size, count, sample_size) is accepted


def test_context_cache_is_lax_and_dynamic_cache_is_strict() -> None:
    history = [1, 2, 3, 4, 5, 9, 9]  # "1 2 3 4" seen once, followed by 5
    context = [7, 1, 2, 3, 4]
    assert draft_tokens(context, 1, 1, 4, cache_of(history), NgramCache(), NgramCache()) == [5]
    assert draft_tokens(context, 1, 1, 4, NgramCache(), cache_of(history), NgramCache()) == []
    twice = cache_of(history + history)  # a 4-gram seen twice passes the strict sample size of 2
    assert draft_tokens(context, 1, 1, 4, NgramCache(), twice, NgramCache()) == [5]


def test_static_cache_alone_needs_two_sightings_of_the_2gram() -> None:
    context = [8, 3, 4]
    once, twice = cache_of([3, 4, 6], 2, 2), cache_of([3, 4, 6, 3, 4, 6], 2, 2)
    assert draft_tokens(context, 1, 1, 4, NgramCache(), NgramCache(), once) == []
    assert draft_tokens(context, 1, 1, 4, NgramCache(), NgramCache(), twice) == [6]
    # the static cache is looked up on the last 2 tokens of context + draft, step by step
    chain = cache_of([3, 4, 6, 7, 3, 4, 6, 7], 2, 2)  # "6 7" -> 3 only once: the draft stops
    assert draft_tokens(context, 3, 1, 4, NgramCache(), NgramCache(), chain) == [6, 7]


def test_longest_ngram_wins_over_a_frequent_short_one() -> None:
    # after "2" comes 9 three times, but after "1 2" comes 5 twice
    history = [1, 2, 5, 1, 2, 5, 0, 2, 9, 0, 2, 9, 0, 2, 9]
    context = [1, 2]
    assert draft_tokens(context, 1, 1, 4, cache_of(history), NgramCache(), NgramCache()) == [5]
    assert draft_tokens([0, 2], 1, 1, 4, cache_of(history), NgramCache(), NgramCache()) == [9]


def test_ngram_sizes_come_from_the_config() -> None:
    history = [1, 2, 3, 4, 5]  # only the 4-gram "1 2 3 4" has one sighting (enough at size 4)
    context = [1, 2, 3, 4]
    assert draft_tokens(context, 1, 1, 4, cache_of(history), NgramCache(), NgramCache()) == [5]
    assert draft_tokens(context, 1, 1, 3, cache_of(history), NgramCache(), NgramCache()) == [5]
    assert draft_tokens(context, 1, 1, 2, cache_of(history), NgramCache(), NgramCache()) == []


def test_short_contexts() -> None:
    caches = (cache_of(PATTERN * 3), NgramCache(), NgramCache())
    assert draft_tokens([], 4, 1, 4, *caches) == []
    assert draft_tokens([11], 4, 1, 4, *caches) == []  # llama.cpp needs LLAMA_NGRAM_STATIC tokens
    assert draft_tokens([14, 15], 2, 1, 4, *caches) == [11, 12]


# --------------------------------------------------------------------------- LookupDrafter
def test_repeated_pattern_is_drafted() -> None:
    lookup = drafter()
    prompt = PATTERN * 3
    lookup.begin(prompt)
    draft = lookup.propose(prompt, 7)
    # every token a unanimous 4-gram of the prompt, seen twice: the strongest evidence there is
    assert draft == Draft(tokens=(11, 12, 13, 14, 15, 11, 12), probs=None, source="lookup",
                          evidence=(("context", True, True, True),) * 7)
    assert all(type(token) is int for token in draft.tokens)


def test_max_tokens_is_honoured() -> None:
    lookup = drafter()
    prompt = PATTERN * 3
    lookup.begin(prompt)
    for max_tokens in (0, 1, 3, 16):
        assert len(lookup.propose(prompt, max_tokens)) == max_tokens


def test_empty_draft_when_nothing_matches() -> None:
    lookup = drafter()
    prompt = list(range(100, 140))  # no n-gram repeats
    lookup.begin(prompt)
    assert lookup.propose(prompt, 8) is EMPTY_DRAFT
    assert lookup.propose(prompt, 8) == Draft()


def test_context_grows_incrementally_and_matches_a_fresh_build() -> None:
    lookup = drafter()
    sequence = [1, 2, 3] + PATTERN * 4 + [7, 8] + PATTERN * 2
    lookup.begin(sequence[:3])
    for length in range(3, len(sequence) + 1, 2):
        lookup.propose(sequence[:length], 4)
        assert lookup.context_cache == cache_of(sequence[:length])


def test_a_context_that_is_not_a_continuation_rebuilds_the_context_cache() -> None:
    lookup = drafter()
    lookup.begin(PATTERN * 3)
    other = [21, 22, 21, 22, 21]
    assert lookup.propose(other, 2).tokens == (22, 21)
    assert lookup.context_cache == cache_of(other)


def test_context_cache_resets_per_request() -> None:
    lookup = drafter()
    lookup.begin(PATTERN * 3)
    assert len(lookup.propose(PATTERN * 3, 4)) == 4
    prompt = [99, 11, 12]  # the old request's pattern, but no end(): nothing was learned
    lookup.begin(prompt)
    assert lookup.propose(prompt, 4) is EMPTY_DRAFT
    assert lookup.context_cache == cache_of(prompt)


def test_dynamic_cache_learns_across_requests_and_persists(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()  # the folder must exist: no folders are created by a parameter
    dynamic_path = tmp_path / "sub" / "dynamic.bin"
    lookup = drafter(dynamic_path=str(dynamic_path))
    finished = [5, 6] + PATTERN * 3
    lookup.begin(finished[:4])
    lookup.end(finished)
    assert lookup.dynamic_cache == cache_of(finished)
    prompt = [99, 11, 12]  # only the dynamic cache knows what follows "11 12"
    lookup.begin(prompt)
    assert lookup.propose(prompt, 3).tokens == (13, 14, 15)
    lookup.close()
    reloaded = drafter(dynamic_path=str(dynamic_path))
    assert reloaded.dynamic_cache == lookup.dynamic_cache
    reloaded.begin(prompt)
    assert reloaded.propose(prompt, 3).tokens == (13, 14, 15)


def test_close_creates_the_file_but_does_not_rewrite_an_unchanged_cache(tmp_path: Path) -> None:
    dynamic_path = tmp_path / "dynamic.bin"
    lookup = drafter(dynamic_path=str(dynamic_path))
    lookup.close()
    # as llama.cpp's lookup example, always a file: here an empty learned cache (header only)
    assert learned_cache.load(dynamic_path, "") == NgramCache()
    learned_cache.save(cache_of(PATTERN), dynamic_path, "")
    inode = dynamic_path.stat().st_ino
    lookup = drafter(dynamic_path=str(dynamic_path))
    lookup.begin(PATTERN)
    lookup.propose(PATTERN, 4)
    lookup.close()
    assert dynamic_path.stat().st_ino == inode  # not replaced
    assert learned_cache.load(dynamic_path, "") == cache_of(PATTERN)


def test_observe_counts_verified_drafts() -> None:
    stats = SpecStats()
    stats.observe_draft(4, 3, "lookup")
    stats.observe_draft(0, 0, "lookup")
    stats.observe_draft(2, 0, "lookup")
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 3)
    assert stats.acceptance_rate == pytest.approx(0.5)
    with pytest.raises(ValueError, match="accepted"):
        stats.observe_draft(2, 3)


def test_bad_cache_files_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(CacheFormatError, match="does not exist"):
        LookupDrafter(LookupConfig(static_path=str(tmp_path / "missing.bin")))
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(b"\x01\x00\x00")
    for config in (LookupConfig(static_path=str(corrupt)),):  # a corrupt dynamic one: moved aside
        with pytest.raises(CacheFormatError, match="byte offset 0"):
            LookupDrafter(config)
    with pytest.raises(ValueError, match="not both"):
        LookupDrafter(LookupConfig(static_path=str(corrupt)), static_cache=NgramCache())


def test_static_cache_file_is_loaded(tmp_path: Path) -> None:
    static_path = tmp_path / "static.bin"
    cache_of([3, 4, 6, 3, 4, 6], 2, 2).save(static_path)
    lookup = LookupDrafter(LookupConfig(static_path=str(static_path)))
    lookup.begin([8, 3, 4])
    assert lookup.propose([8, 3, 4], 1).tokens == (6,)


def test_injected_caches_are_used_and_the_dynamic_one_is_saved(tmp_path: Path) -> None:
    static, dynamic = cache_of([3, 4, 6, 3, 4, 6], 2, 2), NgramCache()
    dynamic_path = tmp_path / "dynamic.bin"
    lookup = LookupDrafter(LookupConfig(dynamic_path=str(dynamic_path)), static_cache=static,
                           dynamic_cache=dynamic)
    assert lookup.static_cache is static and lookup.dynamic_cache is dynamic
    lookup.begin([8, 3, 4])
    assert lookup.propose([8, 3, 4], 1).tokens == (6,)
    lookup.end([8, 3, 4, 6])
    lookup.close()
    assert learned_cache.load(dynamic_path, "") == dynamic == cache_of([8, 3, 4, 6])


class ReadCountingSequence(Sequence[int]):
    """A token list that counts how many elements the drafter reads."""

    def __init__(self, tokens: List[int]) -> None:
        self.tokens = tokens
        self.elements_read = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> List[int]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[int, List[int]]:
        found = self.tokens[index]
        self.elements_read += len(found) if isinstance(found, list) else 1
        return found

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("the drafter iterated over the whole context")


def test_propose_reads_only_the_new_tokens_of_a_long_context() -> None:
    tokens = (list(range(500)) + PATTERN * 4) * 4  # ~2100 tokens
    lookup = drafter()
    lookup.begin(tokens[:2000])
    for length in range(2000, len(tokens)):
        context = ReadCountingSequence(tokens[:length])
        lookup.propose(context, 8)
        # a constant: the new token and the 4 before it, the last 4 tokens twice (continuation
        # check, kept tail), the 4 the draft starts from; never the whole context
        assert context.elements_read <= 1 + 4 + 2 * 4 + 4


def test_propose_cost_on_a_1000_token_context() -> None:
    """Not a benchmark: a guard that drafting stays far below a decode step (~25 ms here).
    CPU time of this process, so that other processes on the machine do not make it flaky."""
    tokens = (list(range(200)) + PATTERN * 20) * 4  # 1200 tokens
    lookup = drafter()
    lookup.begin(tokens[:1000])
    started = time.process_time()
    for length in range(1000, 1200):
        lookup.propose(tokens[:length], 8)
    per_call_s = (time.process_time() - started) / 200
    assert per_call_s < 0.005, f"{per_call_s * 1e3:.2f} ms per propose"


# ------------------------------------------------------------------- the embedded model's tokens
def test_drafts_in_the_embedded_models_tokens(embedded_model_path: Path, tmp_path: Path) -> None:
    prompt_text = ("move the arm to the left shelf. open the gripper. "
                   "move the arm to the right shelf. open the gripper. move the arm to the")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("go to the left door. go to the left door.")
    static_path = tmp_path / "static.bin"
    assert lookup_create.main([str(corpus), "-o", str(static_path),
                               "-m", str(embedded_model_path), "-q"]) == 0
    prompt, right, left = lookup_create.tokenize_texts(
        str(embedded_model_path),
        [text.encode() for text in (prompt_text, prompt_text + " right shelf. open",
                                    prompt_text + " left")])
    assert right[:len(prompt)] == prompt and left[:len(prompt)] == prompt

    # "the arm to the" was followed once by "left", once by "right": a tie at 50 % (enough for a
    # 4-gram), the one seen last wins; then "arm to the right" -> "shelf" -> "." -> "open".
    context_only = drafter()
    context_only.begin(prompt)
    assert context_only.propose(prompt, 4).tokens == tuple(right[len(prompt):])

    # The corpus says "to the" -> "left": the static weight breaks the tie the other way.
    with_static = LookupDrafter(LookupConfig(static_path=str(static_path)))
    with_static.begin(prompt)
    assert with_static.propose(prompt, 1).tokens == tuple(left[len(prompt):])


# ------------------------------------------------- optional cross-check with llama.cpp's own tool
def native_tool(name: str) -> Path:
    """A binary built by scripts/build_native_tools.sh (in the cache dir of scripts/setup.sh)."""
    cache = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")
    return cache / "native" / "bin" / name


def replay_lookup_stats(lookup: LookupDrafter, tokens: Sequence[int], chunk_size: int,
                        max_draft: int) -> Tuple[int, int]:
    """(drafted, accepted) of ``lookup`` replaying ``tokens`` as llama-lookup-stats does: chunks
    of ``chunk_size`` tokens (the last partial chunk skipped), each a request that starts from its
    first token and "generates" the rest; every step drafts, accepts the draft's prefix that
    matches the text, then takes one token from the text; the request's n-grams go to the
    dynamic cache at its end."""
    stats = SpecStats()
    for chunk_start in range(0, len(tokens) - chunk_size, chunk_size):
        chunk = tokens[chunk_start:chunk_start + chunk_size]
        output = list(chunk[:1])
        lookup.begin(output)
        while len(output) < chunk_size:
            draft = lookup.propose(output, max_draft).tokens
            matching = 0
            while (matching < len(draft) and len(output) < chunk_size
                   and draft[matching] == chunk[len(output)]):
                output.append(draft[matching])
                matching += 1
            stats.observe_draft(len(draft), matching)
            if len(output) < chunk_size:
                output.append(chunk[len(output)])
        lookup.end(output)
    return stats.num_draft_tokens, stats.num_accepted_tokens


def robot_log(lines: int, seed: int) -> str:
    """Text with the repetition n-gram drafting feeds on, and many 1:1 ties."""
    rng = random.Random(seed)
    objects = ["red cube", "blue cube", "green ball", "small box", "tool"]
    places = ["the table", "the left shelf", "the right shelf", "the bin", "the charger"]
    return "\n".join(
        f"step {i}: move the {rng.choice(objects)} from {rng.choice(places)} "
        f"to {rng.choice(places)}; status {rng.choice(['ok', 'ok', 'retry', 'failed'])}."
        for i in range(lines))


@pytest.mark.skipif(not native_tool("llama-lookup-stats").is_file(),
                    reason=f"cross-check against llama.cpp skipped: {native_tool('llama-lookup-stats')} is not "
                           "built (run `bash scripts/build_native_tools.sh`, ~7 min on 2 cores; "
                           ".ci/run builds it)")
@pytest.mark.parametrize("with_static_cache", [False, True], ids=["no-static", "static"])
def test_replays_llama_lookup_stats_exactly(tmp_path: Path, embedded_model_path: Path,
                                            with_static_cache: bool) -> None:
    chunk_size, max_draft = 256, 8  # llama.cpp's smallest context is 256 tokens
    corpus = tmp_path / "log.txt"
    corpus.write_text(robot_log(lines=120, seed=3))
    command = [str(native_tool("llama-lookup-stats")), "-m", str(embedded_model_path),
               "-f", str(corpus), "-c", str(chunk_size), "--spec-draft-n-max", str(max_draft),
               "-t", "1", "-ngl", "0"]
    static_cache = NgramCache()
    if with_static_cache:
        static_path = tmp_path / "static.bin"
        other_corpus = tmp_path / "other.txt"
        other_corpus.write_text(robot_log(lines=200, seed=4))
        assert lookup_create.main([str(other_corpus), "-o", str(static_path),
                                   "-m", str(embedded_model_path), "-q"]) == 0
        static_cache = NgramCache.load(static_path)
        command += ["-lcs", str(static_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    log = completed.stdout + completed.stderr
    assert completed.returncode == 0, log[-2000:]
    native = tuple(int(re.search(rf"{name}\s*=\s*(\d+)", log).group(1))  # type: ignore[union-attr]
                   for name in ("n_drafted", "n_accept"))

    (tokens,) = lookup_create.tokenize_texts(str(embedded_model_path), [corpus.read_bytes()])
    assert len(tokens) > 4 * chunk_size
    ours = replay_lookup_stats(LookupDrafter(LookupConfig(), static_cache=static_cache), tokens,
                               chunk_size, max_draft)
    assert native[0] > 100  # the text is repetitive enough to draft a lot
    assert ours == native


TAG_40 = "vocab-1-40-" + "ab" * 20  # a vocabulary of 40 tokens: ids 0..39


def test_no_draft_holds_an_id_outside_the_vocabulary() -> None:
    """Q7, defence in depth: a static cache of another model (llama-lookup-create run on another
    GGUF) drafted ids the target lacks, and llama.cpp refused the whole batch. With the vocabulary
    known (given, or named by the tag), a draft ends before the first such id; a slot's too."""
    static = cache_of([3, 4, 6, 40, 3, 4, 6, 40], 2, 2)  # "3 4" -> 6, "4 6" -> 40 (twice each)
    unbounded = LookupDrafter(LookupConfig(), static_cache=static)
    unbounded.begin([8, 3, 4])
    assert unbounded.propose([8, 3, 4], 4).tokens[:2] == (6, 40)  # what the cache holds
    for lookup in (LookupDrafter(LookupConfig(), static_cache=static, n_vocab=40),
                   LookupDrafter(LookupConfig(), static_cache=static, vocab_tag=TAG_40)):
        assert lookup.n_vocab == 40
        for one in (lookup, lookup.for_slot(1)):
            one.begin([8, 3, 4])
            draft = one.propose([8, 3, 4], 4)
            assert draft.tokens == (6,) and len(draft.evidence) == 1
            assert one.propose([8, 3, 4, 6], 4) is EMPTY_DRAFT
            one.end([8, 3, 4, 6])


def test_a_static_cache_file_with_ids_outside_the_vocabulary_is_refused(tmp_path: Path) -> None:
    """Q7: a static cache file is llama.cpp's plain format (no vocabulary named), so one built for
    another model loaded; a token id past this model's vocabulary tells it apart."""
    static_path = tmp_path / "other-model.lcd"
    cache_of([3, 4, 6, 40, 3, 4, 6, 40], 2, 2).save(static_path)
    for options in ({"vocab_tag": TAG_40}, {"n_vocab": 40}):
        with pytest.raises(CacheFormatError, match="outside this model's vocabulary of 40 tokens"):
            LookupDrafter(LookupConfig(static_path=str(static_path)), **options)
    assert len(LookupDrafter(LookupConfig(static_path=str(static_path)), n_vocab=41).static_cache) > 0


def test_a_learned_cache_with_ids_outside_the_vocabulary_is_moved_aside(tmp_path: Path) -> None:
    """Q7: a learned file of this vocabulary's tag whose records hold an id past it is damaged:
    moved aside with a warning as a broken one is, and learning starts again."""
    dynamic_path = tmp_path / "dynamic.bin"
    learned_cache.save(cache_of([3, 4, 6, 40, 3, 4, 6, 40]), dynamic_path, TAG_40)
    data = dynamic_path.read_bytes()
    lookup = LookupDrafter(LookupConfig(dynamic_path=str(dynamic_path)), vocab_tag=TAG_40)
    assert len(lookup.dynamic_cache) == 0 and len(lookup.warnings) == 1, lookup.warnings
    assert "outside this model's vocabulary of 40 tokens" in lookup.warnings[0]
    assert "moved it to" in lookup.warnings[0]
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == data and not dynamic_path.exists()
