"""After any mix of requests the engine still writes the model's own text: a differential check
against a fresh engine.

A seeded random workload drives one engine (one request at a time, and three at once): plain
prompts seen and unseen, chat turns with tools (every ``tool_choice``, multi-turn with tool
results, long enough to pass the sliding window: the snapshots of conversations.py), constrained
requests, cancels at random steps, time budgets that end prompts, prompt reuse on and off and
``spec.mode`` / K changes between requests. After every few requests the engine answers a set of
reference requests (greedy, ``off``: plain prompts seen and unseen, a chat turn) and each answer
is compared token for token with what a fresh engine of the same configuration answered.

One at a time the answers must be the fresh engine's exactly under the exact build. Several at
once, a reference request's KV cells lie elsewhere in the unified cache than in a fresh one, so
its sums run in another order (docs/design.md, "Several requests at once"): its tokens may part
from the fresh engine's only at a near-tie, a position where the fresh engine's logits of the two
tokens are within :data:`NEAR_TIE`.

Model: a tiny random-weight Gemma 3 (F32, a :data:`WINDOW`-position sliding window, Gemma 3's chat
turns); a window that short makes every chat turn outgrow it, which is what the engine before
its fix got wrong: llama.cpp's sliding-window cache takes a cell of another sequence whose window
has passed it as free and drops that sequence's oldest positions, and the engine kept reusing
the sequence's prefix (its BOS first) without them, writing other text in every later request.
"""
from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import pytest

from gemma_spec_ros.engine.chat import ChatMessage, Conversation, ToolCall, parse_tools
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import EngineError
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.request import GenerationRequest
from support.chat import SKILLS_JSON
from support.tiny_chat_gguf import GEMMA3_STYLE, write_tiny_chat_gguf

WINDOW = 32
N_CTX = 2048
#: The largest gap between a fresh engine's logits of two tokens that counts as a tie where
#: several requests at once change the order of the attention sums (F32: ~1e-6 measured).
NEAR_TIE = 1e-3
MODES = ("off", "lookup", "suffix", "suffix+lookup", "auto")
GREEDY = SamplingParams(temperature=0.0)
SCHEMA = json.dumps({"type": "object", "properties": {"room": {"enum": ["kitchen", "lab", "dock"]},
                                                       "steps": {"type": "integer", "minimum": 1, "maximum": 9}},
                     "required": ["room", "steps"], "additionalProperties": False})
SEEN = ("the robot picks the red cup and puts it in the sink. the robot",
        "step one: open the gripper. step two: move to the shelf. step three:")
UNSEEN = ("a map of the lab: door, bench, door, sink, bench,", "zq xv kk jj qq")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_gguf(tmp_path_factory.mktemp("lossless") / "tiny-gemma3-chat.gguf",
                                template=GEMMA3_STYLE, n_layer=2, seed=4, arch="gemma3",
                                sliding_window=WINDOW)


def make_engine(model: Path, max_running: int) -> Engine:
    return Engine(EngineConfig(
        target=ModelConfig(str(model), n_ctx=N_CTX, n_batch=256, n_threads=1),
        spec=SpecConfig(mode="lookup", draft_max=6),
        chat=ChatConfig(conversation_cache_bytes=16 << 20), max_running=max_running), calibrate=False)


def conversation(rng: random.Random, tool_choice: Optional[str] = None) -> Conversation:
    """A planner's conversation: a system prompt, map notes of random length (the turn outgrows
    the window), sometimes an earlier call and its result."""
    notes = " ".join(f"room{i} is next to room{i + 1}." for i in range(rng.randint(2, 12)))
    messages = [ChatMessage("system", "you plan the moves of a mobile robot."),
                ChatMessage("user", f"map notes: {notes}"), ChatMessage("assistant", "noted."),
                ChatMessage("user", rng.choice(["bring the cup from the kitchen.", "go to the lab."]))]
    if rng.random() < 0.5:
        messages += [ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "move_to", '{"place": "kitchen"}'),)),
                     ChatMessage("tool", '{"arrived": true}', tool_call_id="call_1"),
                     ChatMessage("user", "now pick it up.")]
    choice = tool_choice or rng.choice(["auto", "required", "none", "pick"])
    return Conversation(tuple(messages), parse_tools(SKILLS_JSON), choice, rng.random() < 0.5)


@dataclass(frozen=True)
class Job:
    request: GenerationRequest
    cancel_at: Optional[int] = None  # cancel after this many steps


def random_job(rng: random.Random) -> Job:
    kind = rng.choice(["plain", "plain", "chat", "chat", "schema", "cancel", "budget"])
    sampling = rng.choice([GREEDY, SamplingParams(temperature=0.8, top_k=20, seed=rng.randint(0, 999))])
    fields = dict(max_tokens=rng.randint(4, 40), sampling=sampling, spec_mode=rng.choice(MODES + (None,)),
                  reuse_prompt=rng.random() < 0.85)
    if kind in ("chat", "cancel") and (kind == "chat" or rng.random() < 0.5):
        request = GenerationRequest(conversation=conversation(rng), **fields)
    elif kind == "schema":
        request = GenerationRequest(prompt=rng.choice(SEEN) + " as json:", json_schema=SCHEMA,
                                    **dict(fields, max_tokens=40))
    else:
        request = GenerationRequest(prompt=rng.choice(SEEN + UNSEEN[:1]) * rng.randint(1, 4), **fields)
    if kind == "budget":
        request = replace(request, time_budget=rng.choice([1e-4, 1e-3, 0.01]))
    return Job(request, rng.randint(0, 4) if kind == "cancel" else None)


def run_job(engine: Engine, job: Job) -> None:
    cancel = threading.Event()
    try:
        for n, _ in enumerate(engine.generate(job.request, cancel)):
            if job.cancel_at is not None and n >= job.cancel_at:
                cancel.set()
    except EngineError:  # a request the engine refuses (too long for the context) is part of a mix
        pass


def references(rng_seed: int = 0) -> List[GenerationRequest]:
    chat = conversation(random.Random(rng_seed), tool_choice="none")
    plain = [GenerationRequest(prompt=p, max_tokens=24, sampling=GREEDY, spec_mode="off") for p in SEEN + UNSEEN]
    return plain + [GenerationRequest(conversation=chat, max_tokens=24, sampling=GREEDY, spec_mode="off")]


def tokens_of(engine: Engine, request: GenerationRequest) -> Tuple[int, ...]:
    return tuple(t for step in engine.generate(request) for t in step.tokens)


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first position where ``a`` and ``b`` differ (the shorter one's length if one is a
    prefix of the other); None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Fresh:
    """A fresh engine's answers to the references, and its logits to judge a difference by."""

    def __init__(self, model: Path, max_running: int, requests: List[GenerationRequest]) -> None:
        with make_engine(model, max_running) as engine:
            self.prompts = [engine.prompt_tokens(request) for request in requests]
            self.answers = [tokens_of(engine, request) for request in requests]
        self.model = model

    def gap(self, index: int, got: Sequence[int]) -> float:
        """How far apart the fresh engine's logits of its own token and ``got``'s are, at the first
        position they differ (infinite where one of them ended the text there)."""
        want = self.answers[index]
        at = first_difference(got, want)
        if at is None or at >= len(got) or at >= len(want):
            return float("inf")
        model = LlamaModel(ModelConfig(str(self.model), n_ctx=N_CTX, n_threads=1))
        try:
            context = list(self.prompts[index]) + list(want[:at])
            row = model.decode(context, [len(context) - 1])[-1]
            return abs(float(row[want[at]]) - float(row[got[at]]))
        finally:
            model.close()


def check_against(fresh: Fresh, engine: Engine, requests: List[GenerationRequest], exact: bool,
                  when: str) -> None:
    for index, request in enumerate(requests):
        got = tokens_of(engine, request)
        if got == fresh.answers[index]:
            continue
        gap = fresh.gap(index, got)
        assert not exact and gap < NEAR_TIE, (
            f"{when}: reference {index} parted from a fresh engine's text at token "
            f"{first_difference(got, fresh.answers[index])} (logit gap {gap:.4g}): "
            f"{got} != {fresh.answers[index]}")


def drive(model: Path, max_running: int, exact: bool, rounds: int = 6, jobs_per_round: int = 6) -> None:
    """The random workload on an engine of ``max_running``, the references checked after each
    round against a fresh engine's answers (exactly, or up to near-ties)."""
    requests = references()
    fresh = Fresh(model, max_running, requests)
    rng = random.Random(7 + max_running)
    with make_engine(model, max_running) as engine:
        for round_ in range(rounds):
            threads: List[threading.Thread] = []
            for _ in range(jobs_per_round):
                if rng.random() < 0.3:  # an operator's `ros2 param set spec.*` between requests
                    engine.update_spec(replace(engine.spec, mode=rng.choice(MODES), draft_max=rng.randint(1, 8)))
                thread = threading.Thread(target=run_job, args=(engine, random_job(rng)))
                thread.start()
                threads.append(thread)
                if len(threads) % max_running == 0:  # one at a time, or three together
                    for waiting in threads:
                        waiting.join(timeout=300)
            for thread in threads:
                thread.join(timeout=300)
                assert not thread.is_alive(), "a request never ended"
            check_against(fresh, engine, requests, exact, f"after round {round_}")


@pytest.mark.parametrize("max_running", [1, 3])
def test_output_stays_the_fresh_engines_after_a_random_workload(model: Path, max_running: int) -> None:
    """One at a time and three at once, in any build: the references' tokens are the fresh
    engine's, or part from them only at a near-tie (the default build's sums depend on batch
    shapes; several at once on where the cells lie)."""
    drive(model, max_running, exact=False)


@pytest.mark.exact
def test_one_at_a_time_the_output_is_the_fresh_engines_token_for_token(exact_build: None, model: Path) -> None:
    """Under the exact build with F32 weights, one request at a time: token for token."""
    drive(model, 1, exact=True)
