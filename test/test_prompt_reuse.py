"""Prompt (prefix) reuse: a request evaluates only the prompt tokens after its common prefix with
the previous request's KV cache; with F16 weights the output is bit-identical to evaluating the
whole prompt from an empty cache (ENV.md: F16 logits do not depend on batch shapes in this build).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.types import (EngineConfig, GenerationRequest, ModelConfig, SamplingParams,
                                         SpecConfig)

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
    tokens: List[int] = []
    for step in engine.generate(request):
        tokens.extend(step.tokens)
    return tokens, step.stats.num_prompt_tokens, step.stats.num_prompt_tokens_reused


@pytest.fixture(scope="module")
def f16_engine(f16_model_path: Path) -> Iterator[Engine]:
    engine = Engine(EngineConfig(target=ModelConfig(str(f16_model_path), n_ctx=1024),
                                 spec=SpecConfig(mode="off", draft_max=3, adaptive=False)))
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
@pytest.mark.parametrize("mode", ["lookup"])  # drafts, verify batches and rollbacks on top of reuse
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
