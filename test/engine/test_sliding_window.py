"""Output past the sliding-window ring: identical to plain decoding wherever that is promised; a
prefix is kept only with its window, whatever the cache.

llama.cpp's window-sized cache for sliding-window layers (``swa_full=false``) is a ring of
``pad256(n_swa + n_ubatch)`` cells. A rollback that frees cells across the ring's end (rejected
drafts of a verify pass, prompt reuse trimming the previous request's tail) moves the write head
back to the lowest freed cell, so the next token lands in another cell than plain decoding puts it
in; attention sums cells in cell order, so the same positions then give other floats. The engine
therefore keeps the full cache wherever bit-identical output is promised (the exact build, F16/F32
weights): these tests fill the ring of a tiny Gemma 3 model (F32, a 16-position window, ring 256
cells at n_batch 65) several times over, with rollbacks across its end, and compare the logits
every emitted token was sampled from, bit for bit. Each failed on the window cache (the engine
before this fix): 16 of 400 one-token rows, and the reuse and speculation runs, differed.

The full cache loses positions too (llama/model.py, "Several sequences"): a KV snapshot leaves out
the sliding-window cells its window has passed, and with several sequences another sequence's rows
take them. The last tests make each case on purpose and check that the prefix left without its
window is never kept (before the check, it was: every later request of that sequence attended
without its first positions).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.conversations import ConversationCache
from gemma_spec_ros.engine.llama.model import LlamaModel, WindowLostError
from gemma_spec_ros.engine.llama.process import batch_invariant_build
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.sampling import Sampler
from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine, collect
from support.tiny_gguf import write_tiny_gguf

WINDOW = 16
N_BATCH = 65  # ring of pad256(16 + 65) = 256 cells in the window-sized cache
RING = 256
GREEDY = SamplingParams()
# a seed whose text runs 260 tokens before the tiny model samples its end-of-sequence token
SEEDED = SamplingParams(temperature=0.5, top_k=10, seed=6)
PROMPT = "the robot picks the red cup and puts it in the sink. " * 4


@pytest.fixture(scope="module")
def tiny_swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("swa") / "tiny-swa.gguf", vocab_size=64,
                           n_embd=32, n_layer=2, seed=3, arch="gemma3", sliding_window=WINDOW)


def tiny_engine(path: Path, flash_attn: bool = False) -> Engine:
    return build_engine(path, n_ctx=1024, n_batch=N_BATCH, flash_attn=flash_attn,
                        spec=SpecConfig(mode="off", draft_max=4, adaptive=False))


@pytest.fixture
def sampled_rows(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Digests of every logit row the engine samples a token from, in order: with ``exact``
    verification one row per emitted token, so equal lists mean bit-identical distributions."""
    digests: List[str] = []
    sample = Sampler.sample

    def recording(self: Sampler, logits: np.ndarray, rng: np.random.Generator) -> int:
        digests.append(hashlib.sha1(np.ascontiguousarray(logits).tobytes()).hexdigest())
        return sample(self, logits, rng)

    monkeypatch.setattr(Sampler, "sample", recording)
    return digests


def run(engine: Engine, rows: List[str], prompt: str, sampling: SamplingParams, mode: str,
        reuse: bool = False, max_tokens: int = 400) -> Tuple[List[int], List[str], int, int, int]:
    """(tokens, digests of their rows, drafted, accepted, prompt tokens reused) of one request."""
    del rows[:]
    request = GenerationRequest(prompt, max_tokens=max_tokens, sampling=sampling, spec_mode=mode,
                                reuse_prompt=reuse)
    done = collect(engine, request)
    tokens, stats = done.tokens, done.stats
    return (tokens, rows[:len(tokens) + 1], stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_prompt_tokens_reused)


def test_the_full_cache_is_kept_wherever_output_must_be_bit_identical(tiny_swa_model: Path,
                                                                       embedded_model_path: Path) -> None:
    with tiny_engine(tiny_swa_model) as engine:  # F32 weights: bit-identical reuse is promised
        assert engine.model_info()["target"]["sliding_window_cache"] == "full"
    with build_engine(embedded_model_path, n_ctx=1024, n_batch=512) as engine:  # Q4_K_M
        expected = "full" if batch_invariant_build() else "window"  # the fast build keeps the speed
        assert engine.model_info()["target"]["sliding_window_cache"] == expected


@pytest.mark.parametrize("flash_attn", [False, True])
def test_one_token_decodes_after_a_rollback_across_the_ring_end_equal_plain_decoding(
        tiny_swa_model: Path, flash_attn: bool) -> None:
    """Same shapes in both runs (one token per decode): only the rollback history differs."""
    sequence = [1] + np.random.default_rng(0).integers(3, 64, 399).tolist()
    junk = np.random.default_rng(1).integers(3, 64, 10).tolist()
    runs = []
    for rollback_at in (None, RING - 6):  # junk decoded over the ring's end, then rolled back
        with tiny_engine(tiny_swa_model, flash_attn) as engine:
            target, rows = engine.target, []
            for position, token in enumerate(sequence):
                if position == rollback_at:
                    target.decode(junk, [])
                    target.rollback(position)
                rows.append(target.decode([token], [0])[0].copy())
            runs.append(np.array(rows))
    different = np.flatnonzero((runs[0] != runs[1]).any(axis=1))
    assert different.size == 0, f"{different.size} of {len(sequence)} rows differ, first at {different[:1]}"


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prompt_reuse_trimming_across_the_ring_end_gives_the_output_of_a_fresh_prompt(
        tiny_swa_model: Path, sampled_rows: List[str], sampling: SamplingParams) -> None:
    """The first request fills the ring past its end; the second shares all but its prompt's last
    30 characters, so reuse rolls back cells on both sides of the ring's end."""
    second = PROMPT[:-30] + "then it closes the door."
    with tiny_engine(tiny_swa_model) as engine:
        first_tokens = run(engine, sampled_rows, PROMPT, sampling, "off", max_tokens=300)[0]
        assert len(engine.prompt_tokens(GenerationRequest(PROMPT))) + len(first_tokens) > RING + 50
        reused = run(engine, sampled_rows, second, sampling, "off", reuse=True)
        fresh = run(engine, sampled_rows, second, sampling, "off", reuse=False)
    assert reused[4] >= len(PROMPT) - 40  # the shared prefix was reused, not evaluated again
    assert reused[0] == fresh[0]
    assert reused[1] == fresh[1]


@pytest.mark.exact
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_past_the_ring_equals_plain_decoding(exact_build: None, tiny_swa_model: Path,
                                                         sampled_rows: List[str],
                                                         sampling: SamplingParams) -> None:
    """470-610 positions (past the 256-cell ring's end) with many rejected drafts: verify passes
    roll back across the ring's end; every row must equal plain decoding's, bit for bit."""
    with tiny_engine(tiny_swa_model) as engine:
        plain = run(engine, sampled_rows, PROMPT, sampling, "off")
        speculative = run(engine, sampled_rows, PROMPT, sampling, "lookup")
    tokens, digests, drafted, accepted, _ = speculative
    assert drafted - accepted >= 20, (drafted, accepted)  # enough rollbacks to cross the end
    assert len(tokens) == len(plain[0]) and len(PROMPT) + len(tokens) > RING + 150
    assert tokens == plain[0]
    assert digests == plain[1]


def tokens(n: int, seed: int = 0) -> List[int]:
    return [1] + np.random.default_rng(seed).integers(3, 64, n - 1).tolist()


def next_row(model: LlamaModel, prompt: List[int], seq: int = 0) -> np.ndarray:
    """The logits after ``prompt`` in sequence ``seq``, reusing what the sequence keeps."""
    kept = model.reuse_prefix(prompt, keep_last=1, seq=seq)
    return model.decode(prompt[kept:], [len(prompt) - kept - 1], seq=seq)[0].copy()


def test_a_snapshot_serves_only_prompts_that_keep_it_whole(tiny_swa_model: Path) -> None:
    """A snapshot of 100 positions holds the sliding-window cells of its last 16 only: restored for
    a prompt that keeps all of it, the next token's logits are a fresh evaluation's (up to the
    default build's batch shapes); for a prompt
    that shares 60 of its tokens it is not restored, and forced in, prompt reuse starts over."""
    model = LlamaModel(ModelConfig(str(tiny_swa_model), n_ctx=512, n_batch=N_BATCH), full_swa_cache=True)
    try:
        long, cut = tokens(100), tokens(100)[:60] + tokens(20, seed=1)[1:]
        fresh_long, fresh_cut = next_row(model, long + [5]), None
        model.clear()
        fresh_cut = next_row(model, cut)
        model.clear()
        model.decode(long, [])
        cache = ConversationCache(1 << 30, min_gain=8)
        assert cache.save(model) and cache.keys() == [tuple(long)]
        model.clear()
        assert cache.restore_for(model, long + [5]) == 100 and model.window_start() == 100 - WINDOW
        np.testing.assert_allclose(next_row(model, long + [5]), fresh_long, atol=1e-4)  # batch shapes differ
        model.clear()
        assert cache.restore_for(model, cut) == 0 and model.kv_tokens == []  # not worth a restore
        model.decode(long, [])
        model.rollback(len(long))
        cache.save(model)
        model.clear()
        cache.restore_for(model, long + [5])  # in: 100 positions, the window cells of 16
        assert model.reuse_prefix(cut, keep_last=1) == 0 and model.n_past == 0
        np.testing.assert_allclose(next_row(model, cut), fresh_cut, atol=1e-4)
    finally:
        model.close()


def test_a_sequence_whose_cells_another_sequence_took_keeps_no_shorter_prefix(tiny_swa_model: Path) -> None:
    """Three sequences in one unified cache: sequence 1 (60 positions) sits where sequence 2's
    rows are written next, and llama.cpp takes its out-of-window cells for them (dropping its
    positions up to the last one taken). Going on from its end is safe; a shorter prefix is not
    kept (rollback refuses, prompt reuse and sharing start over)."""
    model = LlamaModel(ModelConfig(str(tiny_swa_model), n_ctx=256, n_batch=N_BATCH), full_swa_cache=True, n_seq=3)
    try:
        first, second = tokens(200), tokens(60, seed=2)
        model.decode(first[:65], [], seq=0)
        model.decode(first[65:130], [], seq=0)  # cells 0..129
        model.decode(second, [], seq=1)  # cells 130..189, positions 0..59
        model.rollback(120, seq=0)  # the write head goes back to cell 120
        model.decode(first[120:130], [], seq=0)  # cells 120..129: the head is at sequence 1's cells
        model.decode(tokens(30, seed=3), [], seq=2)  # takes sequence 1's positions out of its window
        lost = model.window_start(1)
        assert lost > 0 and model.past(1) == 60, "llama.cpp did not take sequence 1's cells"
        assert model.window_kept(lost, 60) and model.reusable_prefix(second + [5], keep_last=1, seq=1) == 60
        assert model.reusable_prefix(second[:10] + [5], keep_last=1, seq=1) == 0
        model.share_prefix(1, 2, 10)  # its first 10 positions without their window cells: not shared
        assert model.past(2) == 0
        with pytest.raises(WindowLostError):
            model.rollback(10, seq=1)
        assert model.past(1) == 0
    finally:
        model.close()
