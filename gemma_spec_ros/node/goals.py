"""Goals of the Generate action: validation into engine requests, and the FIFO they wait in.

Nothing here blocks or touches the model except :func:`check_fits`, which asks the engine to count
prompt tokens (thread-safe, about a millisecond).
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Deque, Dict, List, Mapping, Optional, Tuple

from ..engine.api import GenerationEngine
from ..engine.types import (SPEC_MODES, EngineError, GenerationRequest, SamplingParams)


class GoalRejected(ValueError):
    """A goal cannot be served; the message says why (it is logged and kept for diagnostics)."""


def request_from_goal(goal: Any, values: Mapping[str, Any]) -> GenerationRequest:
    """A Generate goal + the node's parameter values -> GenerationRequest, or GoalRejected.

    Goal conventions (see Generate.action): ``max_tokens`` 0 = ``generation.max_tokens``; ``top_p`` 0
    = ``generation.top_p``; ``temperature`` -1 = ``generation.temperature``; ``top_k`` -1 =
    ``generation.top_k``; ``seed`` -1 = ``generation.seed`` (itself -1 = random by default); empty
    ``spec_mode`` = the node's ``spec.mode``; ``time_budget`` 0 = ``generation.time_budget``;
    ``grammar`` and ``json_schema`` both empty = the node's ``generation.grammar`` /
    ``generation.json_schema`` (a goal that sets one replaces both defaults). A zero-initialised goal
    is greedy whatever the node's defaults: 0 is a real temperature, so "use the default" needs its
    own value.

    >>> from types import SimpleNamespace as G
    >>> v = {"generation.max_tokens": 64, "generation.top_p": 0.9, "generation.seed": -1,
    ...      "limits.max_tokens": 256, "generation.time_budget": 0.0, "generation.prompt_cache": True,
    ...      "generation.grammar": "", "generation.json_schema": ""}
    >>> goal = G(prompt="Hi", system_prompt="", use_chat_template=False, max_tokens=0,
    ...          temperature=0.0, top_p=0.0, top_k=0, seed=7, stop=[], spec_mode="", time_budget=0.0,
    ...          grammar="", json_schema="")
    >>> r = request_from_goal(goal, v); (r.max_tokens, r.sampling.top_p, r.spec_mode)
    (64, 0.9, None)
    """
    if not goal.prompt:
        raise GoalRejected("prompt is empty")
    if not math.isfinite(goal.temperature) or (goal.temperature < 0 and goal.temperature != -1):
        raise GoalRejected(f"temperature={goal.temperature}: must be finite and >= 0, "
                           "or -1 for the node's generation.temperature")
    if not math.isfinite(goal.top_p) or not 0.0 <= goal.top_p <= 1.0:
        raise GoalRejected(f"top_p={goal.top_p}: must be in (0, 1], or 0 for the node's default")
    if goal.top_k < -1:
        raise GoalRejected(f"top_k={goal.top_k}: must be >= 0 (0 = no limit), "
                           "or -1 for the node's generation.top_k")
    if goal.spec_mode and goal.spec_mode not in SPEC_MODES:
        raise GoalRejected(f"spec_mode {goal.spec_mode[:32]!r}: expected one of {', '.join(SPEC_MODES)} "
                           "or empty for the node's spec.mode")
    if goal.seed < -1:
        raise GoalRejected(f"seed={goal.seed}: must be >= 0, or -1 for a random seed")
    if not math.isfinite(goal.time_budget) or goal.time_budget < 0:
        raise GoalRejected(f"time_budget={goal.time_budget}: must be >= 0 seconds "
                           "(0 = the node's generation.time_budget)")
    if goal.grammar and goal.json_schema:
        raise GoalRejected("grammar and json_schema are both set: give at most one of the two")
    grammar, json_schema = goal.grammar, goal.json_schema
    if not grammar and not json_schema:
        grammar, json_schema = values["generation.grammar"], values["generation.json_schema"]
    max_tokens = goal.max_tokens or values["generation.max_tokens"]
    if max_tokens > values["limits.max_tokens"]:
        raise GoalRejected(f"max_tokens={max_tokens} exceeds limits.max_tokens={values['limits.max_tokens']}")
    try:
        temperature = values["generation.temperature"] if goal.temperature == -1 else goal.temperature
        top_k = values["generation.top_k"] if goal.top_k == -1 else goal.top_k
        sampling = SamplingParams(temperature=float(temperature), top_k=int(top_k),
                                  top_p=float(goal.top_p or values["generation.top_p"]),
                                  seed=int(values["generation.seed"] if goal.seed == -1 else goal.seed))
        return GenerationRequest(prompt=goal.prompt, max_tokens=int(max_tokens), sampling=sampling,
                                 system_prompt=goal.system_prompt,
                                 use_chat_template=bool(goal.use_chat_template),
                                 stop=tuple(goal.stop), spec_mode=goal.spec_mode or None,
                                 time_budget=float(goal.time_budget or values["generation.time_budget"]),
                                 reuse_prompt=bool(values["generation.prompt_cache"]),
                                 grammar=grammar, json_schema=json_schema)
    except ValueError as exc:
        raise GoalRejected(str(exc)) from exc


def check_input_bounds(goal: Any, values: Mapping[str, Any]) -> None:
    """Raise GoalRejected if the goal's strings exceed the ``limits.*`` size bounds; cheap, and
    done before anything tokenizes or copies them (an unauthenticated client sets their size)."""
    max_bytes = values["limits.max_prompt_bytes"]
    size = len(goal.prompt.encode("utf-8", "replace")) + len(goal.system_prompt.encode("utf-8", "replace"))
    if size > max_bytes:
        raise GoalRejected(f"prompt + system prompt of {size} bytes exceed "
                           f"limits.max_prompt_bytes={max_bytes}")
    max_stops, max_length = values["limits.max_stop_strings"], values["limits.max_stop_length"]
    if len(goal.stop) > max_stops:
        raise GoalRejected(f"{len(goal.stop)} stop strings: more than limits.max_stop_strings={max_stops}")
    longest = max((len(stop) for stop in goal.stop), default=0)
    if longest > max_length:
        raise GoalRejected(f"a stop string of {longest} characters: longer than "
                           f"limits.max_stop_length={max_length}")
    max_grammar = values["limits.max_grammar_bytes"]
    for name in ("grammar", "json_schema"):
        size = len(getattr(goal, name).encode("utf-8", "replace"))
        if size > max_grammar:
            raise GoalRejected(f"{name} of {size} bytes exceeds limits.max_grammar_bytes={max_grammar}")


def check_fits(engine: GenerationEngine, request: GenerationRequest, max_prompt_tokens: int) -> None:
    """Raise GoalRejected if the request's mode is unusable or its prompt is too long.

    Uses the engine's own token count (the templated prompt) and its context check
    (prompt + max_tokens <= n_ctx).
    """
    if request.spec_mode is not None:
        reason = engine.check_spec(replace(engine.spec, mode=request.spec_mode))
        if reason:
            raise GoalRejected(f"spec_mode {request.spec_mode!r}: {reason}")
    try:  # e.g. use_chat_template on a model without a chat template (ValueError)
        prompt_tokens = engine.count_prompt_tokens(request)
    except (EngineError, ValueError) as exc:
        raise GoalRejected(str(exc)) from exc
    if prompt_tokens > max_prompt_tokens:
        raise GoalRejected(
            f"prompt has {prompt_tokens} tokens, more than limits.max_prompt_tokens={max_prompt_tokens}")
    try:
        engine.check_request(request, prompt_tokens)  # the count is the engine's: no second tokenization
    except (EngineError, ValueError) as exc:
        raise GoalRejected(str(exc)) from exc


@dataclass(eq=False)
class Job:
    """An accepted goal. ``cancel`` is handed to ``engine.generate``; setting it stops the request
    at the next step. ``drop_reason`` set = finish without generating (the node was deactivated)."""

    goal_handle: Any  # rclpy.action.server.ServerGoalHandle
    request: Optional[GenerationRequest]  # None: the goal ends unstarted with drop_reason
    accepted_at: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    drop_reason: str = ""
    priority: int = 0  # waiting goals start highest first, FIFO within a level
    preempt: bool = False  # on arrival, stop a running goal of lower priority
    preempted_by: str = ""  # set: stopped by an urgent goal (finish_reason preempted)
    queue_position: int = 0  # the last queue position sent in feedback (0 = none sent yet)
    client_cancelled: bool = False  # its client's cancel was accepted (rclpy marks it CANCELING next)

    @property
    def key(self) -> bytes:
        return bytes(self.goal_handle.goal_id.uuid)

    @property
    def deadline(self) -> float:
        """When the goal's time budget (counted from acceptance) runs out; inf without one."""
        budget = self.request.time_budget if self.request is not None else 0.0
        return self.accepted_at + budget if budget else math.inf

    def budget_spent(self, now: Optional[float] = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline


class JobQueue:
    """The bounded priority queue of accepted goals and the one running goal.

    Goals start one at a time, highest ``priority`` first and in acceptance order within a level; a
    goal that was cancelled or dropped while waiting, or whose time budget ran out while waiting, is
    handed out at once (out of order) so its client gets the result without waiting for the
    running goal. A goal pushed with ``preempt``
    stops a running goal of lower priority at its next step (``preempted_by`` set, cancel event
    set). ``max_depth`` counts waiting goals, not the running one.

    All methods are thread-safe; :meth:`next_to_start` blocks until there is something to start.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: Deque[Job] = collections.deque()
        self._running: Optional[Job] = None
        self._jobs: Dict[bytes, Job] = {}
        self._closed = False
        # set by drop_all (a transition stopped goals), cleared by resume(): a goal that passed the
        # goal callback just before the transition is pushed dropped, whatever the thread timing
        self._dropping = ""

    # -- producers ---------------------------------------------------------------------------------
    def depth(self) -> int:
        """Goals waiting behind the running one.

        A goal accepted while none runs counts as the next to run, not as waiting, even in the
        instant before the dispatcher starts it; so with ``max_depth`` N exactly N goals wait.
        """
        with self._cond:
            waiting = len(self._waiting)
            return waiting if self._running is not None else max(0, waiting - 1)

    def busy(self) -> bool:
        """True if a goal runs or waits."""
        with self._cond:
            return self._running is not None or bool(self._waiting)

    def push(self, job: Job) -> None:
        """Queue an accepted goal behind every waiting goal of its priority or higher."""
        with self._cond:
            if self._dropping and not job.drop_reason:
                job.drop_reason = self._dropping
                job.cancel.set()
            index = next((i for i, other in enumerate(self._waiting) if other.priority < job.priority),
                         len(self._waiting))
            self._waiting.insert(index, job)
            self._jobs[job.key] = job
            running = self._running
            if job.preempt and running is not None and running.priority < job.priority:
                running.preempted_by = (f"preempted by a goal of priority {job.priority} "
                                        f"(this one: {running.priority})")
                running.cancel.set()
            self._cond.notify_all()

    def positions(self) -> List[Tuple[Job, int]]:
        """Each goal that waits behind another, with its queue position (1 = next to start).

        As in :meth:`depth`, a goal accepted while none runs is the next to run, not waiting: it
        gets no position (its first feedback is its first text)."""
        with self._cond:
            waiting = [job for job in self._waiting if not (job.drop_reason or job.cancel.is_set())]
            if self._running is None:
                waiting = waiting[1:]
            return [(job, i + 1) for i, job in enumerate(waiting)]

    def get(self, key: bytes) -> Optional[Job]:
        with self._cond:
            return self._jobs.get(key)

    def has_running(self) -> bool:
        with self._cond:
            return self._running is not None

    def is_running(self, job: Job) -> bool:
        with self._cond:
            return self._running is job

    def cancel(self, key: bytes) -> bool:
        """Ask a goal to stop (at its next step, or before it starts). False if it is unknown."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None:
                return False
            job.client_cancelled = True
            job.cancel.set()
            self._cond.notify_all()
            return True

    def drop_all(self, reason: str) -> None:
        """Cancel the running goal and mark every waiting goal to finish unstarted with ``reason``;
        goals pushed from now on until :meth:`resume` are dropped with it too."""
        with self._cond:
            self._dropping = reason
            for job in self._waiting:
                job.drop_reason = reason
                job.cancel.set()
            if self._running is not None:
                self._running.drop_reason = reason
                self._running.cancel.set()
            self._cond.notify_all()

    def resume(self) -> None:
        """Goals pushed from now on are served again (the node was activated)."""
        with self._cond:
            self._dropping = ""

    def finished(self, job: Job) -> None:
        """A goal's execute callback is done with it."""
        with self._cond:
            if self._running is job:
                self._running = None
            self._jobs.pop(job.key, None)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no goal runs or waits; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running is None and not self._waiting, timeout)

    def close(self) -> None:
        """Wake :meth:`next_to_start` for good (it returns None from now on)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the consumer ------------------------------------------------------------------------------
    def next_to_start(self, poll: float = 0.01) -> Optional[Job]:
        """The next goal to execute, or None once closed.

        A goal whose cancel was requested while waiting is returned only once its goal handle
        reports the cancel (rclpy updates the goal state just *after* the cancel callback), so that
        the execute callback can end it as CANCELED; until then this polls every ``poll`` seconds.
        """
        with self._cond:
            while not self._closed:
                job = self._pick()
                if job is not None:
                    return job
                # wake for the first waiting goal's deadline (it is then ended, out of order)
                wake = min((job.deadline for job in self._waiting), default=math.inf) - time.monotonic()
                if self._cancel_in_flight():
                    wake = min(wake, poll)
                self._cond.wait(None if wake == math.inf else max(wake, 0.0))
            return None

    def _pick(self) -> Optional[Job]:
        now = time.monotonic()
        for job in self._waiting:
            if (job.drop_reason or (job.cancel.is_set() and job.goal_handle.is_cancel_requested)
                    or job.budget_spent(now)):
                self._waiting.remove(job)
                return job
        if self._running is None:
            for job in self._waiting:
                if not job.cancel.is_set():  # a cancel in flight ends unstarted, above
                    self._waiting.remove(job)
                    self._running = job
                    return job
        return None

    def _cancel_in_flight(self) -> bool:
        return any(job.cancel.is_set() and not job.drop_reason for job in self._waiting)
