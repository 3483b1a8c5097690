"""Goals (of either action, Generate or GenerateChat) once they are requests: the engine's checks,
and the queue.

Nothing here blocks or touches the model except :func:`check_fits`, which asks the engine to count
prompt tokens (thread-safe, about a millisecond). No rclpy: a goal handle is only held and asked
``goal_id`` and ``is_cancel_requested``.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

from ..engine.api import GenerationEngine
from ..engine.request import CountedPrompt, GenerationRequest, Step
from ..engine.errors import EngineError
from .messages import GoalRejected

if TYPE_CHECKING:
    from rclpy.action.server import ServerGoalHandle

#: Longest single wait of :meth:`JobQueue.next_to_start` for a waiting goal's deadline. It waits
#: again after waking, so the bound costs nothing; it keeps every wait far below
#: ``threading.TIMEOUT_MAX`` (~9.2e9 s: a longer wait raises OverflowError) whatever a budget says.
MAX_WAIT = 3600.0
#: Log lines a :class:`LogBudget` lets through at once, and the seconds in which it earns them back.
LOG_BURST = 30
LOG_PERIOD = 60.0


def check_fits(engine: GenerationEngine, request: GenerationRequest,
               max_prompt_tokens: int) -> CountedPrompt:
    """The request's prompt as the engine counted it, or GoalRejected if the prompt is too long or
    the engine cannot serve the request (its spec_mode, its grammar).

    The prompt is tokenized here, once: :meth:`~GenerationEngine.generate` takes the result back.
    ``check_request`` is the one check of the request's spec_mode (the goal field's spelling was
    checked by :func:`~gemma_spec_ros.node.messages.request_from_goal`).
    """
    try:  # e.g. use_chat_template on a model without a chat template (ValueError)
        prompt = engine.count_prompt(request)
    except (EngineError, ValueError) as exc:
        raise GoalRejected(str(exc)) from exc
    if prompt.n_tokens > max_prompt_tokens:
        raise GoalRejected(
            f"prompt has {prompt.n_tokens} tokens, more than limits.max_prompt_tokens={max_prompt_tokens}")
    try:
        engine.check_request(request, prompt.n_tokens)
    except (EngineError, ValueError) as exc:
        raise GoalRejected(str(exc)) from exc
    return prompt


class LogBudget:
    """How many lines of one kind (rejected goals, refused parameter changes) reach the log: a
    burst of ``burst`` lines, then one per ``period / burst`` seconds (a token bucket). An
    occasional refusal is always logged with its reason; a client refusing itself in a loop costs
    ``burst`` lines per ``period`` (~5 MB a day at the defaults, not ~1 GiB), and the counts stay
    on /diagnostics. Thread-safe; ``clock`` is injectable for tests.

    >>> now = [0.0]
    >>> budget = LogBudget(burst=2, period=10.0, clock=lambda: now[0])
    >>> [budget.line(f"goal rejected: {i}", "rejections") for i in range(3)]
    ['goal rejected: 0', 'goal rejected: 1', '']
    >>> now[0] = 5.0; budget.line("goal rejected: 3", "rejections")
    'goal rejected: 3 (1 more rejections not logged since the last line; /diagnostics counts them all)'
    """

    def __init__(self, burst: int = LOG_BURST, period: float = LOG_PERIOD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._burst, self._rate, self._clock = burst, burst / period, clock
        self._tokens = float(burst)
        self._refilled_at = clock()
        self._left_out = 0
        self._lock = threading.Lock()

    def line(self, text: str, what: str) -> str:
        """``text`` to log now (with how many ``what`` were left out before it), or '' to log
        nothing."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._refilled_at) * self._rate)
            self._refilled_at = now
            if self._tokens < 1.0:
                self._left_out += 1
                return ""
            self._tokens -= 1.0
            left_out, self._left_out = self._left_out, 0
        if not left_out:
            return text
        return (f"{text} ({left_out} more {what} not logged since the last line; /diagnostics "
                "counts them all)")


@dataclass(eq=False)
class Job:
    """An accepted goal with the request and prompt its goal check made. ``cancel`` is handed to
    ``engine.generate``; setting it stops the request at the next step. ``drop_reason`` set = finish
    without generating (the node was deactivated)."""

    goal_handle: "ServerGoalHandle"
    request: Optional[GenerationRequest]  # None: the goal ends unstarted with drop_reason
    prompt: Optional[CountedPrompt] = None  # the engine's count_prompt of the request
    accepted_at: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    drop_reason: str = ""
    priority: int = 0  # waiting goals start highest first, FIFO within a level
    preempt: bool = False  # on arrival, stop a running goal of lower priority
    preempted_by: str = ""  # set: stopped by an urgent goal (finish_reason preempted)
    queue_position: int = 0  # the last queue position sent in feedback (0 = none sent yet)
    client_cancelled: bool = False  # its client's cancel was accepted (rclpy marks it CANCELING next)
    kind: Any = None  # the GoalKind (node/goal_kinds.py) of the action it came by

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

    def outcome(self, last: Step) -> Tuple[str, str]:
        """The goal's (finish_reason, error) from its last step: a cancel the node made reads
        ``preempted`` (an urgent goal) or carries the drop reason (a transition)."""
        finish_reason = last.finish_reason or "length"
        if finish_reason == "cancelled" and self.preempted_by and not self.drop_reason:
            finish_reason = "preempted"
        if finish_reason == "cancelled" and self.drop_reason:
            return finish_reason, self.drop_reason
        if finish_reason == "preempted":
            return finish_reason, self.preempted_by
        if finish_reason == "timeout" and self.request is not None:
            return finish_reason, f"time_budget of {self.request.time_budget:g} s ran out"
        return finish_reason, last.detail  # e.g. max_tokens ran out before the grammar was complete


class JobQueue:
    """The bounded priority queue of accepted goals and the goals running (at most ``max_running``).

    Goals start highest ``priority`` first and in acceptance order within a level, while fewer than
    ``max_running`` run (the engine's: several requests at once decode in one pass, engine/slots.py);
    a goal that was cancelled or dropped while waiting, or whose time budget ran out while waiting,
    is handed out at once (out of order) so its client gets the result without waiting for a running
    goal. A goal pushed with ``preempt`` while every running place is taken stops the running goal
    of lowest priority below its own at its next step (``preempted_by`` set, cancel event set).
    ``max_depth`` counts waiting goals, not the running ones.

    All methods are thread-safe; :meth:`next_to_start` blocks until there is something to start.
    """

    def __init__(self, max_running: int = 1) -> None:
        self._cond = threading.Condition()
        self._waiting: Deque[Job] = collections.deque()
        self._running: List[Job] = []
        self.max_running = max(1, max_running)
        self._jobs: Dict[bytes, Job] = {}
        self._closed = False
        # set by drop_all (a transition stopped goals), cleared by resume(): a goal that passed the
        # goal callback just before the transition is pushed dropped, whatever the thread timing
        self._dropping = ""

    # -- producers ---------------------------------------------------------------------------------
    def depth(self) -> int:
        """Goals waiting behind the running ones.

        A goal accepted while a running place is free counts as about to run, not as waiting, even
        in the instant before the dispatcher starts it; so with ``max_depth`` N exactly N goals wait.
        """
        with self._cond:
            return max(0, len(self._waiting) - self._free_places())

    def _free_places(self) -> int:
        return max(0, self.max_running - len(self._running))

    def busy(self) -> bool:
        """True if a goal runs or waits."""
        with self._cond:
            return bool(self._running) or bool(self._waiting)

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
            if job.preempt and len(self._running) >= self.max_running:
                lowest = min(self._running, key=lambda other: other.priority, default=None)
                if lowest is not None and lowest.priority < job.priority and not lowest.preempted_by:
                    lowest.preempted_by = (f"preempted by a goal of priority {job.priority} "
                                           f"(this one: {lowest.priority})")
                    lowest.cancel.set()
            self._cond.notify_all()

    def positions(self) -> List[Tuple[Job, int]]:
        """Each goal that waits behind another, with its queue position (1 = next to start).

        As in :meth:`depth`, a goal accepted while none runs is the next to run, not waiting: it
        gets no position (its first feedback is its first text)."""
        with self._cond:
            waiting = [job for job in self._waiting if not (job.drop_reason or job.cancel.is_set())]
            waiting = waiting[self._free_places():]
            return [(job, i + 1) for i, job in enumerate(waiting)]

    def get(self, key: bytes) -> Optional[Job]:
        with self._cond:
            return self._jobs.get(key)

    def has_running(self) -> bool:
        with self._cond:
            return bool(self._running)

    def is_running(self, job: Job) -> bool:
        with self._cond:
            return any(other is job for other in self._running)

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
        """Cancel the running goals and mark every waiting goal to finish unstarted with ``reason``;
        goals pushed from now on until :meth:`resume` are dropped with it too."""
        with self._cond:
            self._dropping = reason
            for job in [*self._waiting, *self._running]:
                job.drop_reason = reason
                job.cancel.set()
            self._cond.notify_all()

    def resume(self) -> None:
        """Goals pushed from now on are served again (the node was activated)."""
        with self._cond:
            self._dropping = ""

    def finished(self, job: Job) -> None:
        """A goal's execute callback is done with it."""
        with self._cond:
            self._running = [other for other in self._running if other is not job]
            self._jobs.pop(job.key, None)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no goal runs or waits; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running and not self._waiting, timeout)

    def close(self) -> None:
        """Wake :meth:`next_to_start` for good (it returns None from now on)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the consumer ------------------------------------------------------------------------------
    def next_to_start(self, poll: float = 0.01) -> Optional[Job]:
        """The next goal to execute, or None once closed.

        A goal whose cancel was requested while waiting is returned only once its goal handle
        reports the cancel, so that the execute callback can end it as CANCELED; until then this
        polls every ``poll`` seconds (why: the rclpy timing notes in goal_server.py).
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
                self._cond.wait(None if wake == math.inf else min(max(wake, 0.0), MAX_WAIT))
            return None

    def _pick(self) -> Optional[Job]:
        now = time.monotonic()
        for job in self._waiting:
            if (job.drop_reason or (job.cancel.is_set() and job.goal_handle.is_cancel_requested)
                    or job.budget_spent(now)):
                self._waiting.remove(job)
                return job
        if len(self._running) < self.max_running:
            for job in self._waiting:
                if not job.cancel.is_set():  # a cancel in flight ends unstarted, above
                    self._waiting.remove(job)
                    self._running.append(job)
                    return job
        return None

    def _cancel_in_flight(self) -> bool:
        return any(job.cancel.is_set() and not job.drop_reason for job in self._waiting)
