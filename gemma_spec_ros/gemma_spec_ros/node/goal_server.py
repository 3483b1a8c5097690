"""``GoalServer``: the node's action servers, ``~/generate`` and ``~/generate_chat``, from a goal's
arrival to its result.

Both actions share everything here: one queue, one dispatcher, the priorities, preemption, time
budgets, cancel and the lifecycle. What differs between them is a
:class:`~gemma_spec_ros.node.goal_kinds.GoalKind` (goal -> checked request, step -> feedback, end
-> result), bound to each action server's callbacks.

One goal's trip, on three threads:

1. goal callback (executor): size bounds, goal -> request (once), room in the queue, the engine's
   checks (the prompt tokenized once) -> accept, or reject with the reason logged and kept;
2. accepted callback (executor, right after): the checked request becomes a
   :class:`~gemma_spec_ros.node.goals.Job` in the :class:`~gemma_spec_ros.node.goals.JobQueue`;
3. dispatcher thread: starts the next job while fewer than the engine's ``max_running`` run (several
   goals at once decode in one pass: engine/slots.py), so waiting goals hold no executor thread;
4. execute callback (an executor task): the engine's steps as feedback, then the result.

The action servers sit in one mutually exclusive callback group, so that "is the queue full?"
and "enqueue" of one goal cannot interleave with another goal's, of either action. A cancel still reaches a running
goal although that group is exclusive: rclpy runs ``execute`` as a separate executor task outside
the group, so the group is free while a goal generates.

rclpy timing. rclpy's action server orders a few things differently from what a goal's client
sees, and these are the waits and retries that make up for it (all of them live in this file):

- The goal callback gets the goal but no handle; the accepted callback that follows gets the handle,
  whose ``request`` is that same goal object. Both run in one task of the exclusive group, so the
  checked request passes from one to the other in a single slot (:attr:`GoalServer._checked`).
- rclpy marks a goal CANCELING only after the cancel callback returned. A goal whose client's cancel
  was accepted therefore waits (:data:`CANCELING_GRACE`, polling) for that mark before it ends, so
  that it ends CANCELED rather than ABORTED; a waiting goal is handed out by
  ``JobQueue.next_to_start`` only once its handle reports the cancel (polling every
  :data:`CANCEL_POLL`).
- A cancel accepted between rclpy's cancel check and its EXECUTE transition makes ``execute()``
  fail (CANCELING -> EXECUTING is invalid): it is tried again, and then ends the goal CANCELED.
- rclpy sets a goal's result after the execute callback returned, and sends it to a client that
  asked for it from a task the executor runs later still: before destroying the action server,
  :meth:`GoalServer.close` waits until the result of every goal that was still open when it began
  has gone out (:class:`ResultDelivery`: rclpy's result futures and its send, private attributes; a
  fixed grace period where they are missing), then lingers :data:`RESULT_LINGER` so that DDS
  delivers it before the server's writer is gone.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from builtin_interfaces.msg import Time
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.action.server import ServerGoalHandle
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.qos import QoSProfile

from ..engine.api import GenerationEngine
from ..engine.stats import SpecStats
from ..engine.request import CountedPrompt, GenerationRequest, Step
from ..engine.errors import EngineError
from .goal_kinds import GOAL_KINDS, GoalKind
from .goals import Job, JobQueue, LogBudget, check_fits
from .messages import GoalRejected, clip

#: Seconds a transition waits for the running goal to stop (it stops at its next step).
STOP_TIMEOUT = 30.0
#: The same wait at shutdown, which must end within SHUTDOWN_BOUND (node/__init__.py): a step or
#: prompt chunk takes well under a second on an Orin; one that takes longer is left to the exit.
SHUTDOWN_STOP_TIMEOUT = 6.0
#: Seconds close() waits for rclpy to send the last results before destroying the action server
#: (the goals themselves have ended by then); RESULT_LINGER of it comes after the last send.
RESULT_GRACE = 2.0
#: Seconds the action server outlives its last result sent at close(): destroying it at once can
#: drop a response DDS has not delivered yet (its writer goes with it).
RESULT_LINGER = 0.5
#: Seconds close() waits for the dispatcher thread to end after the queue is closed.
DISPATCHER_JOIN = 1.0
#: Feedback messages the action server keeps per writer (rclpy's default, 10, lets a burst of
#: one-token steps overwrite messages a busy client has not read: streamed text != result text).
FEEDBACK_DEPTH = 1000
#: Seconds the end of a client-cancelled goal waits for rclpy to mark it CANCELING.
CANCELING_GRACE = 1.0
#: Seconds between the dispatcher's looks at a waiting goal whose cancel rclpy has not marked yet.
CANCEL_POLL = 0.01
#: Seconds the dispatcher pauses after a fault of its own before it goes on (a fault that repeats
#: then costs one report per pause, not a busy loop).
DISPATCH_RETRY = 1.0

#: A goal ended: its result (either action's), seconds since it was accepted, the engine's stats
#: (None: no step made).
Ended = Callable[[Any, float, Optional[SpecStats]], None]


class GoalServer:
    """Serves the goals of ``kinds`` (Generate and GenerateChat) over one engine between
    :meth:`open` and :meth:`close`.

    The node hands in what the goals need of it: ``values`` (the current parameter values),
    ``state`` (its lifecycle state, for the "not active" rejection), ``report_fault`` (an internal
    error: logged, on /diagnostics), ``rejected`` (a goal's rejection reason) and ``ended`` (a goal's
    result, its latency from acceptance and its stats).
    """

    def __init__(self, node: LifecycleNode, *, values: Callable[[], Dict[str, Any]],
                 state: Callable[[], str], report_fault: Callable[[str], None],
                 rejected: Callable[[str], None], ended: Ended,
                 kinds: Sequence[GoalKind] = GOAL_KINDS) -> None:
        self._node = node
        self._kinds = tuple(kinds)
        self._values, self._state, self._report_fault = values, state, report_fault
        self._rejected, self._ended = rejected, ended
        self._group = MutuallyExclusiveCallbackGroup()
        self._engine: Optional[GenerationEngine] = None
        self._jobs: Optional[JobQueue] = None
        self._dispatcher: Optional[threading.Thread] = None
        self._action_servers: Dict[str, ActionServer] = {}  # by the kind's name
        self._deliveries: List[ResultDelivery] = []
        self._accepting = False
        self._stop_reason = ""  # why goals stopped being accepted (deactivate, cleanup, ...)
        # the goal the goal callback accepted last, with its request and prompt (see rclpy timing)
        self._checked: Optional[Tuple[Any, GenerationRequest, CountedPrompt]] = None
        self._orphans: Dict[bytes, str] = {}  # accepted goals that could not be queued -> why
        self._rejection_log = LogBudget()  # a client sending bad goals in a loop must not fill the disk
        # queue-position feedback comes from the executor (a goal queued) and the dispatcher (a
        # goal started): one at a time, so a stale position is never published last
        self._positions_lock = threading.Lock()
        #: the request log (engine/request_log.py), set by the node's configure; None: off
        self.traffic: Any = None

    # -- the node's transitions --------------------------------------------------------------------
    def open(self, engine: GenerationEngine, result_timeout: float) -> None:
        """Create the action servers over ``engine`` (configure); goals are refused until
        :meth:`activate`."""
        self._engine = engine
        self._jobs = JobQueue(engine.max_running)
        self._dispatcher = threading.Thread(target=self._dispatch, name="gemma_spec_dispatch",
                                            daemon=True)
        self._dispatcher.start()
        for kind in self._kinds:
            server = ActionServer(
                self._node, kind.action, f"~/{kind.name}", execute_callback=partial(self._execute, kind),
                goal_callback=partial(self._on_goal, kind), handle_accepted_callback=partial(self._on_accepted, kind),
                cancel_callback=self._on_cancel, callback_group=self._group,
                result_timeout=max(1, round(result_timeout)),
                feedback_pub_qos_profile=QoSProfile(depth=FEEDBACK_DEPTH))
            self._action_servers[kind.name] = server
            self._deliveries.append(ResultDelivery(server))

    def activate(self) -> None:
        """Accept goals from now on."""
        if self._jobs is not None:
            self._jobs.resume()
        self._accepting = True

    def stop(self, reason: str, timeout: float = STOP_TIMEOUT) -> None:
        """Refuse new goals; stop the running one at its next step; end the waiting ones unstarted
        (waits up to ``timeout`` seconds for that)."""
        self._stop_reason = reason
        self._accepting = False
        jobs = self._jobs
        if jobs is None:
            return
        jobs.drop_all(reason)
        if not jobs.wait_idle(timeout):
            self._node.get_logger().error(f"goals still running {timeout:.0f} s after: {reason}")

    def close(self, reason: str, stop_timeout: float = STOP_TIMEOUT) -> None:
        """:meth:`stop`, then end the dispatcher and destroy the action server (cleanup).
        Waits at most ``stop_timeout`` + :data:`DISPATCHER_JOIN` + :data:`RESULT_GRACE` seconds."""
        open_goals = [delivery.watch() for delivery in self._deliveries]
        self.stop(reason, stop_timeout)
        if self._jobs is not None:
            self._jobs.close()
        if self._dispatcher is not None:  # it ends once the queue is closed (it starts no goal)
            self._dispatcher.join(timeout=DISPATCHER_JOIN)
        deadline = time.monotonic() + RESULT_GRACE  # one grace for all the servers' results
        for server, delivery, goals in zip(self._action_servers.values(), self._deliveries, open_goals):
            delivery.wait_sent(goals, max(0.0, deadline - time.monotonic()))
            server.destroy()
        self._action_servers, self._deliveries = {}, []
        self._engine = self._jobs = self._dispatcher = None

    # -- what diagnostics shows ---------------------------------------------------------------------
    def depth(self) -> int:
        """Goals waiting behind the running ones."""
        jobs = self._jobs
        return jobs.depth() if jobs is not None else 0

    def running(self) -> bool:
        jobs = self._jobs
        return jobs.has_running() if jobs is not None else False

    def busy(self) -> bool:
        """True if a goal runs or waits."""
        jobs = self._jobs
        return jobs.busy() if jobs is not None else False

    def dispatcher_state(self) -> str:
        """'running', 'stopped' (its thread ended while configured: no goal starts) or '' when
        unconfigured."""
        dispatcher = self._dispatcher
        if dispatcher is None:
            return ""
        return "running" if dispatcher.is_alive() else "stopped"

    # -- goal, accepted and cancel callbacks (executor) ---------------------------------------------
    def _on_goal(self, kind: GoalKind, goal: Any) -> GoalResponse:
        """Accept or reject a goal without blocking; a rejection's reason is logged and kept."""
        self._checked = None
        try:
            request, prompt = self._check_goal(kind, goal)
        except Exception as exc:  # noqa: BLE001  any failure to validate a goal is a rejection
            reason = str(exc)
            if not isinstance(exc, GoalRejected):
                reason = f"internal error while checking the goal: {exc!r}"
                self._report_fault(reason)
            reason = clip(reason)
            self._rejected(reason)
            line = self._rejection_log.line(f"goal rejected: {reason}", "rejections")
            if line:
                self._node.get_logger().warning(line)
            return GoalResponse.REJECT
        self._checked = (goal, request, prompt)
        return GoalResponse.ACCEPT

    def _check_goal(self, kind: GoalKind, goal: Any) -> Tuple[GenerationRequest, CountedPrompt]:
        engine, jobs = self._engine, self._jobs
        if not self._accepting or engine is None or jobs is None:
            raise GoalRejected(f"the node is {self._state()}, not active")
        values = self._values()
        request = kind.request(goal, values)
        max_depth = values["queue.max_depth"]
        if jobs.busy() and jobs.depth() >= max_depth:
            raise GoalRejected(f"queue full: {jobs.depth()} goals waiting (queue.max_depth={max_depth})")
        return request, check_fits(engine, request, values["limits.max_prompt_tokens"])

    def _on_accepted(self, kind: GoalKind, goal_handle: ServerGoalHandle) -> None:
        """Queue an accepted goal; if that fails, the goal still ends (ABORTED with the reason)."""
        try:
            self._queue_accepted(kind, goal_handle)
        except Exception as exc:  # noqa: BLE001
            reason = f"internal error while queueing the goal: {exc!r}"
            self._report_fault(reason)
            self._orphans[bytes(goal_handle.goal_id.uuid)] = reason
            try:
                goal_handle.execute(partial(self._execute, kind))
            except Exception as again:  # noqa: BLE001
                self._report_fault(f"cannot end the goal: {again!r}")

    def _queue_accepted(self, kind: GoalKind, goal_handle: ServerGoalHandle) -> None:
        """Queue an accepted goal with the request its goal check made; the dispatcher starts it."""
        checked, self._checked = self._checked, None
        jobs = self._jobs
        if jobs is None:  # cleaned up between accept and here
            goal_handle.execute(partial(self._execute, kind))
            return
        goal = goal_handle.request
        if checked is None or checked[0] is not goal:
            raise RuntimeError("the accepted goal is not the one the goal callback checked")
        job = Job(goal_handle, checked[1], checked[2], priority=goal.priority, preempt=goal.preempt, kind=kind)
        if not self._accepting:  # a transition stopped goals after this one passed the goal callback
            job.drop_reason = self._stop_reason
        jobs.push(job)
        self._publish_queue_positions(jobs)

    def _publish_queue_positions(self, jobs: JobQueue) -> None:
        """Feedback to every waiting goal whose queue position changed (1 = starts next)."""
        with self._positions_lock:
            for job, position in jobs.positions():
                if position != job.queue_position:
                    job.queue_position = position
                    try:
                        job.goal_handle.publish_feedback(job.kind.queue_feedback(position))
                    except Exception as exc:  # noqa: BLE001  the goal ended meanwhile
                        self._node.get_logger().debug(f"queue position feedback skipped: {exc!r}")

    def _on_cancel(self, goal_handle: ServerGoalHandle) -> CancelResponse:
        """Accept a cancel for a known goal; it stops at its next step (or before it starts)."""
        try:
            jobs = self._jobs
            if jobs is not None and jobs.cancel(bytes(goal_handle.goal_id.uuid)):
                return CancelResponse.ACCEPT
        except Exception as exc:  # noqa: BLE001
            self._report_fault(f"cancel callback failed: {exc!r}")
        return CancelResponse.REJECT

    # -- the dispatcher thread ----------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Execute goals in queue order, at most the engine's ``max_running`` at once (see
        JobQueue), until the queue is closed.

        A fault of the loop itself is reported and the loop goes on: this thread is the only one
        that starts goals, and a node that looks active but starts nothing loses every goal."""
        jobs = self._jobs
        while jobs is not None:
            try:
                job = jobs.next_to_start(poll=CANCEL_POLL)
            except Exception as exc:  # noqa: BLE001
                self._report_fault(f"the goal dispatcher failed and goes on: {exc!r}")
                time.sleep(DISPATCH_RETRY)
                continue
            if job is None:
                return
            try:
                self._publish_queue_positions(jobs)
                self._start(job.goal_handle)
            except Exception as exc:  # noqa: BLE001  e.g. the context went away; nothing to serve
                self._report_fault(f"cannot start a goal: {exc!r}")
                jobs.finished(job)

    @staticmethod
    def _start(goal_handle: ServerGoalHandle) -> None:
        """``execute()`` the goal, once more if a cancel raced it (see rclpy timing)."""
        try:
            goal_handle.execute()
        except Exception:  # noqa: BLE001
            if not goal_handle.is_cancel_requested:
                raise
            goal_handle.execute()

    # -- the execute callback (an executor task) ----------------------------------------------------
    def _execute(self, kind: GoalKind, goal_handle: ServerGoalHandle) -> Any:
        """Run the goal if it is the running one, else end it unstarted."""
        jobs = self._jobs
        job = jobs.get(bytes(goal_handle.goal_id.uuid)) if jobs is not None else None
        if job is None:
            error = self._orphans.pop(bytes(goal_handle.goal_id.uuid), "the node was cleaned up")
            result = kind.unstarted("cancelled", error)
            self._end_goal(goal_handle, result)
            return result
        try:
            unstopped = not (job.drop_reason or job.cancel.is_set())
            if unstopped and job.budget_spent():  # ran out while waiting (ended at once, out of turn)
                result = kind.unstarted(
                    "timeout", f"time_budget of {job.request.time_budget:g} s ran out while waiting")
                stats = None
            elif jobs.is_running(job) and job.request is not None:
                result, stats = self._generate(kind, job, job.request)
            else:
                reason = job.drop_reason or "cancelled before it started"
                result, stats = kind.unstarted("cancelled", reason), None
            if job.client_cancelled and result.finish_reason in ("cancelled", "preempted"):
                self._await_canceling(goal_handle)
            self._end_goal(goal_handle, result)
            self._ended(result, time.monotonic() - job.accepted_at, stats)
            return result
        finally:
            jobs.finished(job)

    def _generate(self, kind: GoalKind, job: Job, request: GenerationRequest) -> Tuple[Any, Optional[SpecStats]]:
        """Stream one request through the engine; never raises."""
        engine = self._engine
        if engine is None:
            return self._failed(kind, [], None, "the node was cleaned up"), None
        goal_handle = job.goal_handle
        min_period = self._values()["feedback.min_period"]
        queue_wait = time.monotonic() - job.accepted_at
        if request.time_budget:  # the budget counts from acceptance: the wait is spent
            request = replace(request, time_budget=max(1e-3, request.time_budget - queue_wait))
        parts: List[str] = []
        unsent: List[str] = []
        last_feedback = -math.inf
        step: Optional[Step] = None
        try:
            for step in engine.generate(request, cancel=job.cancel, prompt=job.prompt):
                parts.append(step.text)
                unsent.append(step.text)
                if goal_handle.is_cancel_requested:
                    job.cancel.set()
                now = time.monotonic()
                if step.finish_reason is not None or now - last_feedback >= min_period:
                    goal_handle.publish_feedback(kind.feedback(step, "".join(unsent)))
                    unsent.clear()
                    last_feedback = now
        except EngineError as exc:
            return self._failed(kind, parts, step, str(exc)), None
        except Exception as exc:  # noqa: BLE001  a bug in one request must not stop the node
            self._node.get_logger().error(f"unexpected error in the engine: {exc!r}")
            return self._failed(kind, parts, step, f"internal error: {exc!r}"), None
        finally:  # a failed cache save or deferred close is the node's fault, not this goal's
            for fault in engine.take_faults():
                self._report_fault(fault)
        if step is None:
            return self._failed(kind, parts, step, "the engine produced no step"), None
        step.stats.queue_wait = queue_wait
        finish_reason, error = job.outcome(step)
        traffic = self.traffic  # finished goals only; a failed write is the node's fault, not the goal's
        fault = traffic.record(request, "".join(parts), finish_reason, step) if traffic is not None else ""
        if fault:
            self._report_fault(fault)
        try:
            return kind.result("".join(parts), finish_reason, error, step, self._stamp()), step.stats
        except Exception as exc:  # noqa: BLE001  stats the message cannot carry: the text still goes back
            return self._failed(kind, parts, None, f"internal error: the result cannot be built: {exc!r}"), None

    def _failed(self, kind: GoalKind, parts: List[str], step: Optional[Step], error: str) -> Any:
        self._node.get_logger().error(f"request failed: {error}")
        return kind.result("".join(parts), "error", error, step, self._stamp())

    def _stamp(self) -> Time:
        return self._node.get_clock().now().to_msg()

    @staticmethod
    def _await_canceling(goal_handle: ServerGoalHandle) -> None:
        """Wait for rclpy to mark a client-cancelled goal CANCELING (see rclpy timing)."""
        deadline = time.monotonic() + CANCELING_GRACE
        while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
            time.sleep(0.002)

    def _end_goal(self, goal_handle: ServerGoalHandle, result: Any) -> None:
        """Set the goal's terminal state from the result's finish_reason."""
        try:
            if result.finish_reason in ("stop", "length", "tool_calls"):
                goal_handle.succeed()
            elif result.finish_reason in ("cancelled", "preempted") and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            else:  # timeout, preempted, engine error, or stopped by a transition, not by its client
                goal_handle.abort()
        except Exception as exc:  # noqa: BLE001  the context is shutting down
            self._node.get_logger().warning(f"cannot set the goal's final state: {exc}")


class ResultDelivery:
    """Which results of the action server's goals rclpy has sent, while it closes (see rclpy timing).

    rclpy keeps one result future per goal (``_result_futures``); a client's result request adds a
    done callback to it, which the executor runs as a task of its own after the future is set, and
    that task sends the response (``_send_result_response``). The send is wrapped, so that the sends
    made while the server closes are counted.
    """

    def __init__(self, server: ActionServer) -> None:
        self._futures: Optional[Dict[bytes, Any]] = getattr(server, "_result_futures", None)
        self._lock = threading.Lock()
        self._closing = False
        self._sent: List[Any] = []  # the futures whose result went out while closing
        self._last_send = 0.0
        send = getattr(server, "_send_result_response", None)
        if self._futures is None or not callable(send):
            self._futures = None
            return

        def sent(request_header: Any, future: Any) -> None:
            send(request_header, future)
            with self._lock:
                if self._closing:
                    self._sent.append(future)
                    self._last_send = time.monotonic()

        server._send_result_response = sent  # looked up at each result request

    def watch(self) -> List[Any]:
        """From now on count the sends; the result futures of the goals still open."""
        with self._lock:
            self._closing = True
        futures = self._futures
        return [] if futures is None else [f for f in list(futures.values()) if not f.done()]

    def wait_sent(self, open_goals: List[Any], timeout: float) -> None:
        """Wait until the result of each of ``open_goals`` was sent (a goal whose client never asked
        waits the whole time), then :data:`RESULT_LINGER`; at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if self._futures is None:  # another rclpy: a fixed grace period instead
            time.sleep(min(timeout, RESULT_LINGER * 2))
            return
        pending = list(open_goals)
        while pending and time.monotonic() < deadline - RESULT_LINGER:
            with self._lock:
                pending = [f for f in pending if not any(f is s for s in self._sent)]
            if pending:
                time.sleep(0.01)
        with self._lock:
            last = self._last_send
        if self._futures:  # also a result set just before close() began: its send may be under way
            end = min(deadline, max(last, time.monotonic()) + RESULT_LINGER)
            time.sleep(max(0.0, end - time.monotonic()))
