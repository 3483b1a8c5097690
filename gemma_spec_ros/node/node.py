"""``GemmaSpecNode``: the lifecycle node serving the Generate action over the engine.

Thin by design: the engine does the work; this module wires parameters, goals, feedback and
diagnostics to it.

Lifecycle (the standard ``~/change_state`` / ``~/get_state`` services):

- configure: parameters -> EngineConfig -> Engine (loads target, draft, n-gram caches); creates the
  ``~/generate`` action server and the stats publishers. A missing/corrupt file, an out-of-memory
  load or a vocabulary mismatch returns FAILURE with the reason (naming the files) logged and shown
  in diagnostics; the node stays unconfigured and configures again once the parameter is fixed.
  With ``backend: remote`` configure builds a :class:`~gemma_spec_ros.engine.remote.RemoteEngine`
  over the server at ``remote.url`` instead (a :class:`~gemma_spec_ros.engine.fallback.FallbackEngine`
  over it and the local Engine when ``remote.fallback`` is ``local``); an unreachable server is
  logged and shown in diagnostics, not a failure. Either way the node holds a
  :class:`~gemma_spec_ros.engine.api.GenerationEngine` and calls nothing else on it.
- activate: goals are accepted. deactivate: no new goals; the running goal stops at its next step
  (result ``finish_reason`` cancelled, status ABORTED unless its client cancelled it) and waiting
  goals end unstarted the same way.
- cleanup / shutdown (from any state) / error: stop goals as in deactivate, then ``engine.close()``
  (frees the models, saves the dynamic n-gram cache).

Goals wait in a bounded FIFO (:class:`~gemma_spec_ros.node.goals.JobQueue`); a dispatcher thread
starts them one at a time, so waiting goals hold no executor thread. The action server sits in its
own mutually exclusive callback group so that "is the queue full?" and "enqueue" of one goal cannot
interleave with another goal's; everything else uses a reentrant group. A cancel still reaches a
running goal although that group is exclusive: rclpy runs ``execute`` as a separate executor task
outside the group, so the group is free while a goal generates. Run the node with a
``MultiThreadedExecutor`` of at least :data:`MIN_EXECUTOR_THREADS` threads.

``/diagnostics`` uses a plain publisher created with the node (not a lifecycle publisher), so the
status is published in every state: STALE while unconfigured/inactive, with the last configure
failure in its message, which is where an operator looks first.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from diagnostic_msgs.msg import DiagnosticArray
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import SpecStats as SpecStatsMsg
from rcl_interfaces.msg import SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.action.server import ServerGoalHandle
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import Publisher as LifecyclePublisher
from rclpy.lifecycle import State as LifecycleState
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile
from rclpy.timer import Timer

from ..engine.api import GenerationEngine
from ..engine.engine import Engine
from ..engine.fallback import FallbackEngine
from ..engine.remote import RemoteEngine
from ..engine.stats import SpecStats
from ..engine.types import EngineConfig, EngineError, Step
from . import NODE_NAME, diagnostics
from .goals import GoalRejected, Job, JobQueue, check_fits, check_input_bounds, request_from_goal
from .parameters import (PARAMETERS, PARAMETERS_BY_NAME, as_declared, check_values,
                         engine_config_from, remote_config_from, spec_config_from)

#: Executor threads the node needs: a transition or parameter call, the running goal's execute
#: callback, goal/cancel requests and the diagnostics timer must be able to run at once.
MIN_EXECUTOR_THREADS = 4
#: Seconds a transition waits for the running goal to stop (it stops at its next step).
STOP_TIMEOUT = 30.0
#: Seconds release() then waits for the engine to be idle before leaving the freeing of the models
#: to the running step (a step or prompt chunk on a slow, shared CPU can outlast STOP_TIMEOUT).
CLOSE_TIMEOUT = 5.0
#: Seconds release() waits for rclpy to hand the last results to the action server before
#: destroying it (the goals themselves have ended by then).
RESULT_GRACE = 2.0
#: Feedback messages the action server keeps per writer (rclpy's default, 10, lets a burst of
#: one-token steps overwrite messages a busy client has not read: streamed text != result text).
FEEDBACK_DEPTH = 1000
#: Seconds the end of a client-cancelled goal waits for rclpy to mark it CANCELING (rclpy updates
#: the goal state just after the cancel callback returns ACCEPT).
CANCELING_GRACE = 1.0

#: Characters of a client's string (or a reason quoting one) kept in logs and /diagnostics.
MAX_ECHO = 256

_SUCCESS = TransitionCallbackReturn.SUCCESS
_FAILURE = TransitionCallbackReturn.FAILURE


class GemmaSpecNode(LifecycleNode):
    """Lifecycle node serving ``~/generate`` (gemma_spec_msgs/action/Generate) with speculation.

    Topics: ``/diagnostics`` (DiagnosticArray), ``~/spec_stats`` (SpecStats of each finished
    request), ``~/spec_stats_rolling`` (the engine's lifetime SpecStats every diagnostics.period).
    Parameters: see :mod:`gemma_spec_ros.node.parameters` and docs/parameters.md.
    """

    def __init__(self, node_name: str = NODE_NAME, **kwargs: Any) -> None:
        self._engine: Optional[GenerationEngine] = None
        self._model_info: Dict[str, Any] = {}
        self._action_server: Optional[ActionServer] = None
        self._stats_pub: Optional[LifecyclePublisher] = None
        self._rolling_pub: Optional[LifecyclePublisher] = None
        self._jobs: Optional[JobQueue] = None
        self._dispatcher: Optional[threading.Thread] = None
        self._diag_timer: Optional[Timer] = None
        # the lifecycle state (or transition state) for diagnostics and messages
        self._state = "unconfigured"
        self._accepting = False
        self._stop_reason = ""  # why goals stopped being accepted (deactivate, cleanup, ...)
        self._configure_error = ""
        self._log_lock = threading.Lock()
        # queue-position feedback comes from the executor (a goal queued) and the dispatcher (a
        # goal started): one at a time, so a stale position is never published last
        self._positions_lock = threading.Lock()
        # release() from a transition and from serve's shutdown path at once: one undoes configure,
        # the other finds nothing left to undo
        self._release_lock = threading.Lock()
        self._requests = diagnostics.RequestLog()
        self._orphans: Dict[bytes, str] = {}  # accepted goals that could not be queued -> why
        super().__init__(node_name, **kwargs)

        self._group = ReentrantCallbackGroup()
        self._goal_group = MutuallyExclusiveCallbackGroup()
        for spec in PARAMETERS:
            self.declare_parameter(spec.name, spec.default, spec.descriptor())
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(self._value("diagnostics.period"),
                                             self._publish_diagnostics, callback_group=self._group)

    # -- parameters --------------------------------------------------------------------------------
    def _value(self, name: str) -> Any:
        return self._values()[name]

    def _values(self) -> Dict[str, Any]:
        """Every table parameter's current value, by name."""
        return as_declared({spec.name: self.get_parameter(spec.name).value for spec in PARAMETERS})

    def _on_set_parameters(self, params: List[Parameter]) -> SetParametersResult:
        """Validate a set of parameter changes (refused, logged and on /diagnostics if the check
        itself raises: an exception must never leave a callback and stop the executor)."""
        try:
            return self._check_and_apply(params)
        except Exception as exc:  # noqa: BLE001
            self._report_fault(f"parameter callback failed: {exc!r}")
            return SetParametersResult(successful=False, reason=f"internal error: {exc!r}"[:MAX_ECHO])

    def _check_and_apply(self, params: List[Parameter]) -> SetParametersResult:
        """Validate a set of parameter changes; apply ``spec.*`` to the engine when accepted.

        rclpy has already checked types and ranges. Runs before the values are stored (and on
        Humble there is no post-set callback), so the engine is updated here, after every check;
        ``engine.update_spec`` itself refuses a spec the engine cannot use (e.g. no draft model).
        """
        changes = as_declared({p.name: p.value for p in params if p.name in PARAMETERS_BY_NAME})
        reason = self._check_changes(changes)
        if not reason and self._engine is not None and any(n.startswith("spec.") for n in changes):
            try:
                self._engine.update_spec(spec_config_from({**self._values(), **changes}))
            except ValueError as exc:
                reason = str(exc)
        if reason:
            reason = clip(reason)
            self.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        if "diagnostics.period" in changes and self._diag_timer is not None:
            self._diag_timer.timer_period_ns = int(changes["diagnostics.period"] * 1e9)
        return SetParametersResult(successful=True)

    def _check_changes(self, changes: Dict[str, Any]) -> str:
        """'' if the changes can be accepted in the current state, else the reason."""
        if any(value is None for value in changes.values()):
            return "the node's parameters cannot be undeclared"
        frozen = sorted(n for n in changes if PARAMETERS_BY_NAME[n].configure_time)
        if frozen and self._engine is not None:
            return (f"{', '.join(frozen)} can only change while unconfigured (the node is "
                    f"{self._state}; the models are loaded): run the cleanup transition first")
        return check_values({**self._values(), **changes}, configured=self._engine is not None)

    # -- lifecycle ---------------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Load the models and create the action server; FAILURE (logged) if a file is unusable."""
        values = self._values()  # construction-time values (YAML, launch) bypass the callback
        reason = check_values(values, configured=False)
        if reason:
            return self._configure_failed(f"invalid parameters: {reason}")
        config = engine_config_from(values)
        files = f"target {config.target.resolved_path!r}"
        if config.draft is not None:
            files += f", draft {config.draft.resolved_path!r}"
        remote = values["backend"] == "remote"
        local = not remote or values["remote.fallback"] == "local"
        if remote:
            files = f"server {values['remote.url']}" + (f" (fallback: {files})" if local else "")
        self.get_logger().info(f"configuring: {'loading' if local else 'using'} {files}")
        started = time.monotonic()
        try:
            engine = build_engine(values, config)
        except Exception as exc:  # noqa: BLE001  any failure is a FAILURE with its reason
            return self._configure_failed(f"cannot {'use' if remote else 'load'} {files}: {exc}")
        self._engine = engine
        for warning in engine.warnings:  # the local engine's (a cache moved aside)
            self.get_logger().warning(warning)
        status = engine.status()
        if remote and status["server reachable"] is not True:
            self.get_logger().warning(
                f"inference server {values['remote.url']} unreachable at configure "
                f"({status['server error']}); goals "
                + ("fall back to the local model" if local else "fail until it answers"))
        self._model_info = dict(engine.model_info())
        self._configure_error = ""
        self._jobs = JobQueue()
        self._dispatcher = threading.Thread(target=self._dispatch, name="gemma_spec_dispatch",
                                            daemon=True)
        self._dispatcher.start()
        self._stats_pub = self.create_lifecycle_publisher(SpecStatsMsg, "~/spec_stats", 10)
        self._rolling_pub = self.create_lifecycle_publisher(SpecStatsMsg, "~/spec_stats_rolling", 10)
        self._action_server = ActionServer(
            self, Generate, "~/generate", execute_callback=self._execute,
            goal_callback=self._on_goal, handle_accepted_callback=self._on_accepted,
            cancel_callback=self._on_cancel, callback_group=self._goal_group,
            result_timeout=max(1, round(values["queue.result_timeout"])),
            feedback_pub_qos_profile=QoSProfile(depth=FEEDBACK_DEPTH))
        self._state = "inactive"
        mode = f"backend remote ({status['server']})" if remote else f"spec.mode={config.spec.mode}"
        self.get_logger().info(
            f"configured in {time.monotonic() - started:.1f} s: {mode}, n_ctx={engine.n_ctx}")
        return _SUCCESS

    def _configure_failed(self, reason: str) -> TransitionCallbackReturn:
        self._configure_error = reason
        self.get_logger().error(f"configure failed: {reason}")
        return _FAILURE

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Accept goals from now on."""
        if self._jobs is not None:
            self._jobs.resume()
        self._accepting = True
        self._state = "active"
        self.get_logger().info("active: accepting goals on ~/generate")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Refuse new goals; stop the running one at its next step; end the waiting ones."""
        self._state = "deactivating"
        self._stop_goals("the node was deactivated")
        self._state = "inactive"
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Free the models (saving the dynamic n-gram cache) and the ROS entities of configure."""
        self._state = "cleaningup"
        self.release("the node was cleaned up")
        self._state = "unconfigured"
        return _SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """From any state: stop goals, free everything, save the dynamic cache."""
        self._state = "shuttingdown"
        self.release("the node is shutting down")
        self._state = "finalized"
        return _SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised: release everything and go back to unconfigured."""
        self.get_logger().error(f"error during a transition from {state.label}; releasing the engine")
        self._state = "errorprocessing"
        self.release("the node hit an error")
        self._state = "unconfigured"
        return _SUCCESS

    def _stop_goals(self, reason: str) -> None:
        self._stop_reason = reason
        self._accepting = False
        if self._jobs is None:
            return
        self._jobs.drop_all(reason)
        if not self._jobs.wait_idle(STOP_TIMEOUT):
            self.get_logger().error(f"goals still running {STOP_TIMEOUT:.0f} s after: {reason}")

    def release(self, reason: str) -> None:
        """Stop goals and undo configure (free the models, save the dynamic cache). Idempotent.

        What cleanup and shutdown do; callable directly when no transition can run.
        """
        with self._release_lock:
            self._release(reason)

    def _release(self, reason: str) -> None:
        self._stop_goals(reason)
        if self._jobs is not None:
            self._jobs.close()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=STOP_TIMEOUT)
        if self._action_server is not None:
            self._wait_results_sent(self._action_server, RESULT_GRACE)
            self._action_server.destroy()
        for publisher in (self._stats_pub, self._rolling_pub):
            if publisher is not None:
                self.destroy_lifecycle_publisher(publisher)
        engine, self._engine = self._engine, None
        self._jobs = self._dispatcher = self._action_server = None
        self._stats_pub = self._rolling_pub = None
        self._model_info = {}
        if engine is not None:
            cache = self._value("lookup.dynamic_path")
            try:
                freed = engine.close(timeout=CLOSE_TIMEOUT)
            except Exception as exc:  # noqa: BLE001  the models are freed; the save failed
                self._report_fault(f"dynamic n-gram cache not saved to {cache}: {exc!r}")
                return
            if not freed:  # never free under a running llama_decode: the step frees it when done
                self.get_logger().warning(
                    f"a generation step is still running {CLOSE_TIMEOUT:.0f} s after {reason}: the "
                    "engine frees the models when that step ends")
                return
            self.get_logger().info("engine closed: models freed"
                                   + (f", dynamic n-gram cache saved to {cache}" if cache else ""))

    def _wait_results_sent(self, server: ActionServer, timeout: float) -> None:
        """Wait until rclpy has handed every finished goal's result to the action server.

        ``jobs.finished`` runs inside the execute callback, before rclpy sets the goal's result
        (after the callback returns): destroying the server at once lost the running goal's result.
        """
        futures = getattr(server, "_result_futures", None)
        if futures is None:  # another rclpy: a fixed grace period instead
            time.sleep(min(timeout, 0.5))
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(f.done() for f in list(futures.values())):
            time.sleep(0.01)
        if futures:  # a done future sends its result from a task the executor runs next
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def _report_fault(self, text: str) -> None:
        """An internal error: logged as ERROR and shown on /diagnostics ("last internal error")."""
        self.get_logger().error(text)
        with self._log_lock:
            self._requests.fault(text)

    @property
    def lifecycle_state(self) -> str:
        """unconfigured | inactive | active | finalized (as of the last completed transition)."""
        return self._state

    @property
    def configure_error(self) -> str:
        """Why the last configure failed ('' if it did not)."""
        return self._configure_error

    # -- goals -------------------------------------------------------------------------------------
    def _on_goal(self, goal: Generate.Goal) -> GoalResponse:
        """Accept or reject a goal without blocking; a rejection's reason is logged and kept."""
        try:
            self._check_goal(goal)
        except Exception as exc:  # noqa: BLE001  any failure to validate a goal is a rejection
            reason = str(exc)
            if not isinstance(exc, GoalRejected):
                reason = f"internal error while checking the goal: {exc!r}"
                self._report_fault(reason)
            reason = clip(reason)
            with self._log_lock:
                self._requests.reject(reason)
            self.get_logger().warning(f"goal rejected: {reason}")
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _check_goal(self, goal: Generate.Goal) -> None:
        engine, jobs = self._engine, self._jobs
        if not self._accepting or engine is None or jobs is None:
            raise GoalRejected(f"the node is {self._state}, not active")
        values = self._values()
        check_input_bounds(goal, values)
        request = request_from_goal(goal, values)
        max_depth = values["queue.max_depth"]
        if jobs.busy() and jobs.depth() >= max_depth:
            raise GoalRejected(f"queue full: {jobs.depth()} goals waiting (queue.max_depth={max_depth})")
        check_fits(engine, request, values["limits.max_prompt_tokens"])

    def _on_accepted(self, goal_handle: ServerGoalHandle) -> None:
        """Queue an accepted goal; if that fails, the goal still ends (ABORTED with the reason)."""
        try:
            self._queue_accepted(goal_handle)
        except Exception as exc:  # noqa: BLE001
            reason = f"internal error while queueing the goal: {exc!r}"
            self._report_fault(reason)
            self._orphans[bytes(goal_handle.goal_id.uuid)] = reason
            try:
                goal_handle.execute(self._execute)
            except Exception as again:  # noqa: BLE001
                self._report_fault(f"cannot end the goal: {again!r}")

    def _queue_accepted(self, goal_handle: ServerGoalHandle) -> None:
        """Queue an accepted goal; the dispatcher starts it in turn."""
        jobs = self._jobs
        if jobs is None:  # cleaned up between accept and here
            goal_handle.execute(self._execute)
            return
        goal = goal_handle.request
        try:
            job = Job(goal_handle, request_from_goal(goal, self._values()),
                      priority=goal.priority, preempt=goal.preempt)
        except GoalRejected as exc:  # parameters changed since the goal callback
            job = Job(goal_handle, None, drop_reason=str(exc))
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
                        job.goal_handle.publish_feedback(Generate.Feedback(queue_position=position))
                    except Exception as exc:  # noqa: BLE001  the goal ended meanwhile
                        self.get_logger().debug(f"queue position feedback skipped: {exc!r}")

    def _on_cancel(self, goal_handle: ServerGoalHandle) -> CancelResponse:
        """Accept a cancel for a known goal; it stops at its next step (or before it starts)."""
        try:
            jobs = self._jobs
            if jobs is not None and jobs.cancel(bytes(goal_handle.goal_id.uuid)):
                return CancelResponse.ACCEPT
        except Exception as exc:  # noqa: BLE001
            self._report_fault(f"cancel callback failed: {exc!r}")
        return CancelResponse.REJECT

    def _dispatch(self) -> None:
        """Dispatcher thread: execute goals one at a time, in FIFO order (see JobQueue)."""
        jobs = self._jobs
        while jobs is not None:
            job = jobs.next_to_start()
            if job is None:
                return
            self._publish_queue_positions(jobs)
            try:
                self._start(job.goal_handle)
            except Exception as exc:  # noqa: BLE001  the context went away; nothing to serve
                self._report_fault(f"cannot start a goal: {exc!r}")
                jobs.finished(job)

    @staticmethod
    def _start(goal_handle: ServerGoalHandle) -> None:
        """``execute()`` the goal. A cancel accepted between rclpy's cancel check and its EXECUTE
        transition makes that transition fail (CANCELING -> EXECUTING is invalid); the second try
        sees the cancel, skips the transition and runs the execute callback, which ends the goal
        CANCELED (else the goal never got a result)."""
        try:
            goal_handle.execute()
        except Exception:  # noqa: BLE001
            if not goal_handle.is_cancel_requested:
                raise
            goal_handle.execute()

    def _execute(self, goal_handle: ServerGoalHandle) -> Generate.Result:
        """Execute callback: run the goal if it is the running one, else end it unstarted."""
        jobs = self._jobs
        job = jobs.get(bytes(goal_handle.goal_id.uuid)) if jobs is not None else None
        if job is None:
            error = self._orphans.pop(bytes(goal_handle.goal_id.uuid), "the node was cleaned up")
            result = Generate.Result(finish_reason="cancelled", error=error)
            self._end_goal(goal_handle, result)
            return result
        try:
            unstopped = not (job.drop_reason or job.cancel.is_set())
            if unstopped and job.budget_spent():  # ran out while waiting (ended at once, out of turn)
                result = Generate.Result(
                    finish_reason="timeout",
                    error=f"time_budget of {job.request.time_budget:g} s ran out while waiting")
                stats = None
            elif jobs.is_running(job) and job.request is not None:
                result, stats = self._generate(job)
            else:
                reason = job.drop_reason or "cancelled before it started"
                result, stats = Generate.Result(finish_reason="cancelled", error=reason), None
            if job.client_cancelled and result.finish_reason in ("cancelled", "preempted"):
                self._await_canceling(goal_handle)
            self._end_goal(goal_handle, result)
            self._record(job, result, stats)
            return result
        finally:
            jobs.finished(job)

    def _generate(self, job: Job) -> Tuple[Generate.Result, Optional[SpecStats]]:
        """Stream one request through the engine; never raises."""
        engine = self._engine
        goal_handle = job.goal_handle
        min_period = self._value("feedback.min_period")
        queue_wait = time.monotonic() - job.accepted_at
        request = job.request
        if request.time_budget:  # the budget counts from acceptance: the wait is spent
            request = replace(request, time_budget=max(1e-3, request.time_budget - queue_wait))
        parts: List[str] = []
        unsent: List[str] = []
        last_feedback = -math.inf
        step: Optional[Step] = None
        try:
            for step in engine.generate(request, cancel=job.cancel):
                parts.append(step.text)
                unsent.append(step.text)
                if goal_handle.is_cancel_requested:
                    job.cancel.set()
                now = time.monotonic()
                if step.finish_reason is not None or now - last_feedback >= min_period:
                    goal_handle.publish_feedback(_feedback(step, "".join(unsent)))
                    unsent.clear()
                    last_feedback = now
        except EngineError as exc:
            return self._failed(job, parts, step, str(exc)), None
        except Exception as exc:  # noqa: BLE001  a bug in one request must not stop the node
            self.get_logger().error(f"unexpected error in the engine: {exc!r}")
            return self._failed(job, parts, step, f"internal error: {exc!r}"), None
        finally:  # a failed cache save or deferred close is the node's fault, not this goal's
            for fault in engine.take_faults():
                self._report_fault(fault)
        if step is None:
            return self._failed(job, parts, step, "the engine produced no step"), None
        step.stats.queue_wait = queue_wait
        finish_reason = step.finish_reason or "length"
        if finish_reason == "cancelled" and job.preempted_by and not job.drop_reason:
            finish_reason = "preempted"
        result = Generate.Result(
            text="".join(parts), finish_reason=finish_reason,
            prompt_tokens=step.stats.num_prompt_tokens,
            completion_tokens=step.stats.num_generated_tokens, spec_mode=step.spec_mode,
            stats=diagnostics.spec_stats_msg(step.stats, self.get_clock().now().to_msg()))
        if result.finish_reason == "cancelled" and job.drop_reason:
            result.error = job.drop_reason
        elif result.finish_reason == "preempted":
            result.error = job.preempted_by
        elif result.finish_reason == "timeout":
            result.error = f"time_budget of {job.request.time_budget:g} s ran out"
        elif step.detail:  # e.g. max_tokens ran out before the grammar was complete
            result.error = step.detail
        return result, step.stats

    def _failed(self, job: Job, parts: List[str], step: Optional[Step], error: str) -> Generate.Result:
        self.get_logger().error(f"request failed: {error}")
        result = Generate.Result(text="".join(parts), finish_reason="error", error=error)
        if step is not None:
            result.spec_mode = step.spec_mode
            result.completion_tokens = step.stats.num_generated_tokens
            result.prompt_tokens = step.stats.num_prompt_tokens
            result.stats = diagnostics.spec_stats_msg(step.stats, self.get_clock().now().to_msg())
        return result

    @staticmethod
    def _await_canceling(goal_handle: ServerGoalHandle) -> None:
        """A client's cancel was accepted, but rclpy marks the goal CANCELING only after the cancel
        callback returned: wait for it, so that the goal ends CANCELED rather than ABORTED."""
        deadline = time.monotonic() + CANCELING_GRACE
        while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
            time.sleep(0.002)

    def _end_goal(self, goal_handle: ServerGoalHandle, result: Generate.Result) -> None:
        """Set the goal's terminal state from the result's finish_reason."""
        try:
            if result.finish_reason in ("stop", "length"):
                goal_handle.succeed()
            elif result.finish_reason in ("cancelled", "preempted") and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            else:  # timeout, preempted, engine error, or stopped by a transition, not by its client
                goal_handle.abort()
        except Exception as exc:  # noqa: BLE001  the context is shutting down
            self.get_logger().warning(f"cannot set the goal's final state: {exc}")

    def _record(self, job: Job, result: Generate.Result, stats: Optional[SpecStats]) -> None:
        with self._log_lock:
            self._requests.record(result.finish_reason, time.monotonic() - job.accepted_at, stats,
                                  result.error)
        if stats is not None and self._stats_pub is not None:
            self._stats_pub.publish(result.stats)

    # -- diagnostics -------------------------------------------------------------------------------
    def _view(self) -> diagnostics.NodeView:
        engine, jobs = self._engine, self._jobs
        return diagnostics.NodeView(
            node_name=self.get_name(),
            hardware_id=clip(diagnostics.hardware_id(self._value("diagnostics.hardware_id")), 64),
            lifecycle_state=self._state, queue_depth=jobs.depth() if jobs else 0,
            queue_max_depth=self._value("queue.max_depth"),
            running=jobs.has_running() if jobs is not None else False,
            spec=engine.spec if engine is not None else None, model_info=self._model_info,
            configure_error=self._configure_error, backend=engine.status() if engine is not None else {})

    def _publish_diagnostics(self) -> None:
        """Timer: /diagnostics (both statuses) and the rolling SpecStats."""
        try:
            engine = self._engine
            rolling = engine.rolling_stats() if engine is not None else None
            view = self._view()
            stamp = self.get_clock().now().to_msg()
            with self._log_lock:
                statuses = [diagnostics.spec_status(view, self._requests, rolling),
                            diagnostics.models_status(view)]
            self._diag_pub.publish(diagnostics.diagnostic_array(stamp, statuses))
            if rolling is not None and self._rolling_pub is not None:
                self._rolling_pub.publish(diagnostics.spec_stats_msg(rolling, stamp))
        except Exception as exc:  # noqa: BLE001  e.g. the engine closed during this tick
            self.get_logger().warning(f"diagnostics skipped: {exc!r}", throttle_duration_sec=10.0)


def build_engine(values: Dict[str, Any], config: EngineConfig) -> GenerationEngine:
    """The engine ``backend`` names: the local Engine, a RemoteEngine, or (``remote.fallback:
    local``) a FallbackEngine over both; a local engine already loaded is closed if the rest fails."""
    if values["backend"] != "remote":
        return Engine(config)
    local = Engine(config) if values["remote.fallback"] == "local" else None
    try:
        primary = RemoteEngine(remote_config_from(values), config.spec)
    except BaseException:
        if local is not None:
            local.close()
        raise
    return primary if local is None else FallbackEngine(primary, local)


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters (with a note of how many were cut).

    >>> clip("x" * 300, 10)
    'xxxxxxxxxx... (290 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _feedback(step: Step, text: str) -> Generate.Feedback:
    """Feedback for one engine step with the text accumulated since the last feedback."""
    return Generate.Feedback(
        text=text, completion_tokens=step.stats.num_generated_tokens,
        mean_acceptance_length=step.stats.mean_acceptance_length,
        tokens_per_second=step.stats.tokens_per_second, spec_mode=step.spec_mode,
        draft_max=step.draft_max)
