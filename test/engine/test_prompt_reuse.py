"""Prompt (prefix) reuse: a request evaluates only the prompt tokens after its common prefix with
the previous request's KV cache; with F16 weights the output is bit-identical to evaluating the
whole prompt from an empty cache (docs/design.md: F16 logits do not depend on batch shapes).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.errors import KVCacheError
from support.engine import build_engine, collect

SYSTEM = ("You control a mobile manipulator in a kitchen. Skills: move_to(place), pick(object), "
          "place(object, place), open(door), close(door), say(text). Rules: never move while "
          "holding a hot object; always close doors you opened; report failures with say().\n")
INSTRUCTIONS = ("Task: bring the red cup to the sink.\nPlan:\n1.",
                "Task: put the milk back in the fridge.\nPlan:\n1.",
                "Task: wipe the table, then report.\nPlan:\n1.")
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=11)


def generate(engine: Engine, prompt: str, sampling: SamplingParams, reuse: bool,
             mode: str) -> Tuple[List[int], int, int]:
    """(tokens, prompt tokens, prompt tokens reused) of one request."""
    request = GenerationRequest(prompt, max_tokens=10, sampling=sampling, spec_mode=mode,
                                reuse_prompt=reuse)
    done = collect(engine, request)
    return done.tokens, done.stats.num_prompt_tokens, done.stats.num_prompt_tokens_reused


@pytest.fixture(scope="module")
def f16_engine(f16_model_path: Path) -> Iterator[Engine]:
    engine = build_engine(f16_model_path, n_ctx=1024, calibrate=True,
                          spec=SpecConfig(mode="off", draft_max=3, adaptive=False))
    yield engine
    engine.close()


def sequence() -> List[Tuple[str, SamplingParams]]:
    """Requests sharing the system prompt, then one whose prompt is a strict prefix of the one
    before it (the KV cache holds more than the new prompt: it is rolled back)."""
    requests = [(SYSTEM + text, sampling) for text in INSTRUCTIONS[:2] for sampling in (GREEDY, SAMPLED)]
    longest = SYSTEM + INSTRUCTIONS[1]
    requests.append((longest[:len(longest) - 12], GREEDY))
    return requests


@pytest.mark.exact
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["lookup", "suffix"])  # drafts, verify batches and rollbacks on top of reuse
def test_reuse_on_and_off_give_identical_tokens_with_f16(exact_build: None, f16_engine: Engine, mode: str) -> None:
    without = [generate(f16_engine, prompt, sampling, False, mode) for prompt, sampling in sequence()]
    assert all(reused == 0 for _, _, reused in without)
    with_reuse = [generate(f16_engine, prompt, sampling, True, mode) for prompt, sampling in sequence()]
    for (tokens_off, n_prompt, _), (tokens_on, n_prompt_on, reused) in zip(without, with_reuse):
        assert n_prompt == n_prompt_on
        assert tokens_on == tokens_off
    # every request after the first reuses (most of) the shared system prompt; the strict prefix
    # reuses all but its last token
    shared = len(f16_engine.prompt_tokens(GenerationRequest(SYSTEM)))
    for _, n_prompt, reused in with_reuse[1:]:
        assert shared - 2 <= reused <= n_prompt - 1
    assert with_reuse[-1][1] - 3 <= with_reuse[-1][2] <= with_reuse[-1][1] - 1  # cut mid-token


def test_a_failed_request_leaves_nothing_to_reuse(f16_engine: Engine) -> None:
    """After an error inside generate() the KV cache is emptied, so the next request cannot reuse
    a prefix the cache may no longer hold."""
    generate(f16_engine, SYSTEM + INSTRUCTIONS[0], GREEDY, True, "off")
    request = GenerationRequest(SYSTEM + INSTRUCTIONS[1], max_tokens=4)
    steps = f16_engine.generate(request)
    next(steps)
    with pytest.raises(RuntimeError):  # raised inside the generator, where a failure would be
        steps.throw(RuntimeError("the consumer failed"))
    assert f16_engine.target.n_past == 0
    assert generate(f16_engine, SYSTEM + INSTRUCTIONS[1], GREEDY, True, "off")[2] == 0


def test_time_budget_ends_the_request_with_timeout(f16_engine: Engine) -> None:
    request = GenerationRequest(SYSTEM + INSTRUCTIONS[2], max_tokens=400, time_budget=0.5)
    steps = list(f16_engine.generate(request))
    assert steps[-1].finish_reason == "timeout"
    assert 0 < steps[-1].stats.num_generated_tokens < 400
    with pytest.raises(ValueError, match="time_budget"):
        GenerationRequest("x", time_budget=-1.0)


def filler(n: int, vocab: int, offset: int = 0) -> List[int]:
    """``n`` ordinary tokens (past the control ids), no repeats for a while."""
    return [3 + (997 + 7 * (offset + i)) % (vocab - 3) for i in range(n)]


@pytest.mark.timeout(300)
def test_window_sized_sliding_cache_rolls_back_its_last_pass_and_refuses_a_lost_window(
        embedded_model_path: Path) -> None:
    """The target's sliding-window layers keep a window + one batch (Gemma 3: 512 + 256 cells here),
    and overwrite positions out of the window once the cache wraps. Rolling back the last pass's
    tokens (rejected drafts) is safe; a deeper rollback whose window is gone is refused with the
    cache cleared, and prompt reuse then starts over (before the check, reuse kept a prefix whose
    window the sliding layers no longer had)."""
    backend = LlamaModel(ModelConfig(str(embedded_model_path), n_ctx=2048, n_batch=256, n_threads=2),
                           full_swa_cache=False)
    try:
        assert backend.n_swa == 512
        tokens = filler(1000, backend.n_vocab)  # > 768 cells: the sliding cache wraps
        backend.decode(tokens[:-4], [])
        rows = backend.decode(tokens[-4:], range(4))  # a verify pass of 3 drafted tokens
        assert len(rows) == 4
        backend.rollback(len(tokens) - 3)  # reject all 3
        assert backend.n_past == len(tokens) - 3
        again = backend.decode(tokens[-3:], [0])  # the rejected position decodes again
        np.testing.assert_allclose(again[0], rows[1], rtol=1e-3, atol=1e-2)
        with pytest.raises(KVCacheError, match="sliding-window"):
            backend.rollback(100)  # positions 0..99 are still in the full-attention layers only
        assert backend.n_past == 0
        # prompt reuse: a long shared prefix is kept, a short one (its window overwritten) is not
        backend.decode(tokens, [])
        assert backend.reuse_prefix(tokens[:-10] + [5], keep_last=1) == len(tokens) - 10
        backend.decode(tokens[-10:], [])
        assert backend.reuse_prefix(tokens[:50] + filler(20, backend.n_vocab, 5000), keep_last=1) == 0
        assert backend.n_past == 0
        # a short sequence never wraps: any rollback is fine
        backend.decode(tokens[:300], [])
        backend.rollback(10)
        assert backend.n_past == 10
    finally:
        backend.close()


def test_the_engine_uses_the_window_sized_cache_only_when_a_verify_pass_is_one_batch(
        embedded_model_path: Path) -> None:
    """A verify pass split in several llama.cpp batches could roll back past what one batch may
    overwrite: with n_batch below the largest verify pass (65 rows) the target keeps every position."""
    for n_batch, windowed in ((512, True), (32, False)):
        engine = build_engine(embedded_model_path, n_ctx=2048, n_batch=n_batch, n_threads=2)
        try:
            assert engine.target.full_swa_cache is not windowed and engine.target.n_swa == 512
        finally:
            engine.close()
