"""Several requests at once (engine/slots.py): each running request decodes in its own sequence of
the target, and one target pass per round carries every running request's rows.

On the embedded model and its F16 copy. The tests of what a request emits compare it with the same
request served alone by an engine that runs one request at a time (engine.py's own loop); under the
exact build (marked ``exact``) they must be token for token the same, greedy and seeded.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

import jsonschema
import pytest

from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import EngineError
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support.engine import build_engine, collect
from support.tiny_gemma4 import write_gemma4_pair

SYSTEM = ("You control a mobile manipulator in a kitchen. Skills: move_to(place), pick(object), "
          "place(object, place), open(door), close(door), say(text).\n")
PROMPTS = (SYSTEM + "Task: bring the red cup to the sink.\nPlan:\n1.",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "The three laws of robotics are: first, a robot may not injure a human being")
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=7)
N_TOKENS = 48


@dataclass
class Run:
    """One request run in a thread: its steps and when each arrived."""

    request: GenerationRequest
    cancel: threading.Event = field(default_factory=threading.Event)
    steps: List[Step] = field(default_factory=list)
    arrivals: List[float] = field(default_factory=list)
    error: Optional[BaseException] = None

    @property
    def tokens(self) -> List[int]:
        return [t for step in self.steps for t in step.tokens]

    @property
    def finish_reason(self) -> Optional[str]:
        return self.steps[-1].finish_reason if self.steps else None


def run_together(engine: Engine, runs: Sequence[Run],
                 after_step: Optional[Callable[[Run, Step], None]] = None) -> None:
    """Each run's request in a thread of its own, all at once; waits for all of them."""
    def serve(run: Run) -> None:
        try:
            for step in engine.generate(run.request, run.cancel):
                run.steps.append(step)
                run.arrivals.append(time.perf_counter())
                if after_step is not None:
                    after_step(run, step)
        except BaseException as exc:  # noqa: BLE001  the test looks at it
            run.error = exc
    threads = [threading.Thread(target=serve, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a request never ended"


def request(prompt: str, mode: str, sampling: SamplingParams = SamplingParams(), max_tokens: int = N_TOKENS,
            **fields: object) -> GenerationRequest:
    return GenerationRequest(prompt, max_tokens=max_tokens, sampling=sampling, spec_mode=mode, **fields)


@pytest.fixture(scope="module")
def solo(f16_model_path: Path) -> Iterator[Engine]:
    engine = build_engine(f16_model_path, n_ctx=512, spec=SpecConfig(mode="off", draft_max=4, adaptive=False))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def slots(f16_model_path: Path) -> Iterator[Engine]:
    engine = build_engine(f16_model_path, n_ctx=512, max_running=3,
                          spec=SpecConfig(mode="off", draft_max=4, adaptive=False))
    yield engine
    engine.close()


def alone(engine: Engine, req: GenerationRequest) -> List[int]:
    return collect(engine, req).tokens


# -- what several requests at once emit ------------------------------------------------------------
@pytest.mark.exact
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["off", "lookup", "suffix"])
def test_requests_batched_together_emit_what_each_emits_alone_greedy(exact_build: None, solo: Engine,
                                                                     slots: Engine, mode: str) -> None:
    """Three greedy requests whose rows share every pass emit, token for token, what each emits
    served alone. (Their logits are not bit for bit the solo ones: a sequence's KV cells lie
    elsewhere in the unified cache, so attention sums run in another order, up to ~0.02 of a logit
    with F16, measured; greedy decoding crossed no near-tie in any case tested, seeded sampling at
    temperature 0.8 did: docs/design.md, "Several requests at once".)"""
    runs = [Run(request(prompt, mode)) for prompt in PROMPTS]
    run_together(slots, runs)
    for run in runs:
        assert run.error is None, run.error
        assert run.tokens == alone(solo, run.request), (mode, run.request.prompt[:30])


@pytest.mark.exact
@pytest.mark.timeout(600)
def test_a_request_alone_in_a_slot_engine_emits_what_the_one_at_a_time_engine_emits(
        exact_build: None, solo: Engine, f16_model_path: Path) -> None:
    """Alone (the other slots idle, a fresh engine: its sequence's cells are where a one-sequence
    cache puts them), greedy and seeded, drafting or not: bit for bit today's output."""
    engine = build_engine(f16_model_path, n_ctx=512, max_running=3,
                          spec=SpecConfig(mode="off", draft_max=4, adaptive=False))
    try:
        for prompt in PROMPTS:
            for mode, sampling in (("off", SamplingParams()), ("lookup", SamplingParams()), ("lookup", SEEDED)):
                req = request(prompt, mode, sampling)
                assert alone(engine, req) == alone(solo, req), (mode, sampling, prompt[:30])
    finally:
        engine.close()


PLAN_SCHEMA = (Path(__file__).resolve().parents[2] / "gemma_spec_ros" / "config" / "schemas"
               / "robot_plan.schema.json").read_text()


def constrained_together(slots: Engine) -> List[Run]:
    """The three prompts under the plan schema, at once: their verify rows share every pass, and
    the rows whose next token the grammar allows alone ask for no logits (engine.py)."""
    runs = [Run(request(prompt, "lookup", max_tokens=320, json_schema=PLAN_SCHEMA)) for prompt in PROMPTS]
    run_together(slots, runs)
    for run in runs:
        assert run.error is None, run.error
        assert run.steps[-1].stats.num_grammar_sole_rows > 0, run.request.prompt[:30]
    return runs


def test_constrained_requests_together_give_plans_of_the_schema(slots: Engine) -> None:
    for run in constrained_together(slots):
        if run.finish_reason == "stop":
            jsonschema.validate(json.loads("".join(step.text for step in run.steps)), json.loads(PLAN_SCHEMA))
        else:
            assert run.finish_reason == "length", run.finish_reason


@pytest.mark.exact
@pytest.mark.timeout(900)
def test_constrained_requests_batched_together_emit_what_each_emits_alone(exact_build: None, solo: Engine,
                                                                          slots: Engine) -> None:
    for run in constrained_together(slots):
        assert run.tokens == alone(solo, run.request), run.request.prompt[:30]


#: A system prompt every client sends, longer than a prompt chunk (slots.PROMPT_CHUNK).
LONG_SYSTEM = SYSTEM * 4
TASKS = ("Task: bring the red cup to the sink.\nPlan:\n1.", "Task: put the milk in the fridge.\nPlan:\n1.",
         "Task: wipe the table, then report.\nPlan:\n1.")


@pytest.mark.exact
@pytest.mark.timeout(600)
def test_a_shared_system_prompt_is_decoded_once_and_each_request_emits_what_it_emits_alone(
        exact_build: None, solo: Engine, slots: Engine) -> None:
    """Three requests with one long system prompt, sent at once: the first slot decodes it, the
    others take its cells (LlamaModel.share_prefix) and decode only their task; each emits, token
    for token, what it emits alone."""
    runs = [Run(request(LONG_SYSTEM + task, "lookup")) for task in TASKS]
    run_together(slots, runs)
    reused = sorted(run.steps[-1].stats.num_prompt_tokens_reused for run in runs)
    n_system = len(slots.prompt_tokens(request(LONG_SYSTEM, "off"))) - 1
    assert reused[0] < n_system <= reused[1] + 1, reused  # one slot decoded it, two took it
    for run in runs:
        assert run.error is None
        assert run.tokens == alone(solo, run.request), run.request.prompt[-30:]


def test_the_rounds_carry_several_requests_per_pass_and_their_steps_interleave(
        embedded_model_path: Path) -> None:
    engine = build_engine(embedded_model_path, n_ctx=512, max_running=3,
                          spec=SpecConfig(mode="off", draft_max=4, adaptive=False))
    try:
        runs = [Run(request(prompt, "off")) for prompt in PROMPTS]
        run_together(engine, runs)
        for run in runs:
            assert run.error is None and run.finish_reason == "length" and len(run.tokens) == N_TOKENS
        # while all three decode, a pass carries each one's row: their steps arrive in turns
        firsts, lasts = [run.arrivals[1] for run in runs], [run.arrivals[-1] for run in runs]
        assert max(firsts) < min(lasts)
        counts = engine.status()
        assert counts["requests per pass"] > 1.5, counts
        assert counts["requests running"] == "0 of 3"
    finally:
        engine.close()


# -- each request's own cancel, budget, reader and prompt ---------------------------------------------
@pytest.fixture(scope="module")
def busy(embedded_model_path: Path) -> Iterator[Engine]:
    """Slots on the embedded model (Q4_K_M, the default build): what each request gets, not the
    exact tokens."""
    engine = build_engine(embedded_model_path, n_ctx=512, max_running=3,
                          spec=SpecConfig(mode="lookup", draft_max=4))
    yield engine
    engine.close()


def test_a_cancel_ends_only_its_own_request(busy: Engine) -> None:
    runs = [Run(request(prompt, "lookup")) for prompt in PROMPTS]

    def cancel_first(run: Run, step: Step) -> None:
        if run is runs[0] and len(run.steps) == 3:
            run.cancel.set()
    run_together(busy, runs, cancel_first)
    assert runs[0].error is None and runs[0].finish_reason == "cancelled"
    assert len(runs[0].tokens) < N_TOKENS
    for run in runs[1:]:
        assert run.error is None and run.finish_reason == "length" and len(run.tokens) == N_TOKENS


def test_a_time_budget_ends_only_its_own_request(busy: Engine) -> None:
    runs = [Run(request(PROMPTS[0], "lookup", max_tokens=400, time_budget=0.3))]
    runs += [Run(request(prompt, "lookup")) for prompt in PROMPTS[1:]]
    run_together(busy, runs)
    assert runs[0].finish_reason == "timeout"
    assert runs[0].steps[-1].stats.generation_time < 10
    for run in runs[1:]:
        assert run.finish_reason == "length" and len(run.tokens) == N_TOKENS


def test_a_reader_that_stops_reading_frees_its_slot(busy: Engine) -> None:
    """Three readers, each leaving after two steps; then three more requests run to their end
    (they could not, were the first three's slots still held)."""
    for prompt in PROMPTS:
        steps = busy.generate(request(prompt, "lookup"))
        next(steps), next(steps)
        steps.close()
    runs = [Run(request(prompt, "lookup")) for prompt in PROMPTS]
    run_together(busy, runs)
    assert [run.finish_reason for run in runs] == ["length"] * 3
    deadline = time.monotonic() + 10
    while busy.status()["requests running"] != "0 of 3" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy.status()["requests running"] == "0 of 3"


def test_more_requests_than_slots_wait_for_a_free_one(busy: Engine) -> None:
    runs = [Run(request(PROMPTS[i % 3], "lookup", max_tokens=16)) for i in range(7)]
    run_together(busy, runs)
    for run in runs:
        assert run.error is None and run.finish_reason == "length" and len(run.tokens) == 16


def test_a_slot_keeps_its_requests_prompt_for_the_next_one_that_shares_it(busy: Engine) -> None:
    """Prompt reuse per slot: each follow-up lands in the slot whose sequence holds its prefix."""
    firsts = [Run(request(prompt, "lookup", max_tokens=8)) for prompt in PROMPTS]
    run_together(busy, firsts)
    follow_ups = [Run(request(prompt + " and", "lookup", max_tokens=8)) for prompt in PROMPTS]
    run_together(busy, follow_ups)
    for first, run in zip(firsts, follow_ups):
        stats = run.steps[-1].stats
        assert stats.num_prompt_tokens_reused >= first.steps[-1].stats.num_prompt_tokens - 1, \
            (stats.num_prompt_tokens_reused, stats.num_prompt_tokens)


def test_closing_ends_the_running_requests_and_refuses_the_waiting_one(embedded_model_path: Path) -> None:
    engine = build_engine(embedded_model_path, n_ctx=512, max_running=2, spec=SpecConfig(mode="off"))
    runs = [Run(request(PROMPTS[i], "off", max_tokens=400)) for i in range(3)]
    started = threading.Event()
    threads = []

    def serve(run: Run) -> None:
        try:
            for step in engine.generate(run.request, run.cancel):
                run.steps.append(step)
                started.set()
        except BaseException as exc:  # noqa: BLE001
            run.error = exc
    for run in runs:
        threads.append(threading.Thread(target=serve, args=(run,)))
        threads[-1].start()
    assert started.wait(60)
    assert engine.close(timeout=30)
    for thread in threads:
        thread.join(timeout=30)
    ended = [run for run in runs if run.error is None]
    refused = [run for run in runs if run.error is not None]
    assert len(ended) >= 1 and all(run.finish_reason == "cancelled" for run in ended)
    assert all(isinstance(run.error, EngineError) and "closed" in str(run.error) for run in refused)
    with pytest.raises(EngineError, match="closed"):
        next(engine.generate(request(PROMPTS[0], "off")))


# -- what can and cannot run at once -----------------------------------------------------------------
@pytest.mark.exact
def test_a_draft_model_drafts_for_every_running_request(exact_build: None, f16_model_path: Path,
                                                        solo: Engine) -> None:
    """The draft model holds a sequence per slot; each request drafts in its own (F16 target and
    draft, exact build: every request emits what plain decoding alone emits)."""
    engine = build_engine(f16_model_path, f16_model_path, n_ctx=512, max_running=2,
                          spec=SpecConfig(mode="draft", draft_max=3, adaptive=False))
    try:
        runs = [Run(request(prompt, "draft", max_tokens=24)) for prompt in PROMPTS[:2]]
        run_together(engine, runs)
        for run in runs:
            assert run.error is None
            assert run.steps[-1].stats.num_draft_tokens > 0
            assert run.tokens == alone(solo, request(run.request.prompt, "off", max_tokens=24))
    finally:
        engine.close()



def test_an_assistant_or_head_is_refused_with_several_requests_at_once(tmp_path: Path) -> None:
    target, assistant = write_gemma4_pair(tmp_path)
    config = EngineConfig(ModelConfig(str(target), n_ctx=256), ModelConfig(str(assistant), n_ctx=256),
                          spec=SpecConfig(mode="mtp"), max_running=2)
    with pytest.raises(ValueError, match="one request at a time"):
        Engine(config, calibrate=False)


@pytest.mark.parametrize("value", [0, 5])
def test_max_running_is_checked(embedded_model_path: Path, value: int) -> None:
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig(ModelConfig(str(embedded_model_path)), max_running=value)


def test_a_batch_too_small_for_the_slots_is_refused(embedded_model_path: Path) -> None:
    with pytest.raises(ValueError, match="n_batch"):
        build_engine(embedded_model_path, n_ctx=512, max_running=3, n_batch=128)
