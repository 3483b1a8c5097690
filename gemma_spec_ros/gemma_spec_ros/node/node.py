"""``GemmaSpecNode``: the lifecycle node serving the Generate and GenerateChat actions over the engine.

Thin by design: the engine does the work, :class:`~gemma_spec_ros.node.goal_server.GoalServer`
runs the goals; this module holds the parameters, the transitions and the diagnostics.

Lifecycle (the standard ``~/change_state`` / ``~/get_state`` services, in a callback group of their
own: ``~/get_state`` and the parameter services answer while a transition loads the models or waits
for goals to stop; one transition runs at a time, and a request the current state has no transition
for is answered ``success: false``, never an exception that would stop the executor):

- configure: parameters -> every model and cache path checked (the learned cache's folder created
  inside ``lookup.cache_dir`` if missing), then the engine
  (:mod:`~gemma_spec_ros.node.engine_factory`: the local models, or the inference server at
  ``remote.url``); the ``~/generate`` and ``~/generate_chat`` action servers and the stats publishers. A missing/corrupt
  file, an out-of-memory load or a vocabulary mismatch returns FAILURE with the reason (naming the
  files) logged and shown in diagnostics (ERROR); the node stays unconfigured and configures again
  once the parameter is fixed. An unreachable server is logged and shown in diagnostics, not a
  failure. Parameters cannot change while it runs (the values it read would no longer hold).
- activate: goals are accepted. deactivate: no new goals; the running goal stops at its next step
  (result ``finish_reason`` cancelled, status ABORTED unless its client cancelled it) and waiting
  goals end unstarted the same way.
- cleanup / shutdown (from any state) / error: stop goals as in deactivate, then ``engine.close()``
  (frees the models, saves the dynamic n-gram cache). Shutdown waits less for each (its waits sum
  to less than :data:`~gemma_spec_ros.node.SHUTDOWN_BOUND`).

Run the node with a ``MultiThreadedExecutor`` of at least :data:`MIN_EXECUTOR_THREADS` threads.
``/diagnostics`` uses a plain publisher created with the node (not a lifecycle publisher), so the
status is published in every state: OK "unconfigured" / "inactive" (its state key-value also reads
the transition states, e.g. ``configuring``), ERROR with the reason after a failed configure, which
is where an operator looks first; never STALE, which the aggregator reserves for a node it no longer
hears (see :mod:`~gemma_spec_ros.node.diagnostics`).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

from diagnostic_msgs.msg import DiagnosticArray
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import SpecStats as SpecStatsMsg
from lifecycle_msgs.srv import ChangeState
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNodeMixin
from rclpy.lifecycle import Publisher as LifecyclePublisher
from rclpy.lifecycle import State as LifecycleState
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.timer import Timer

from ..engine.api import GenerationEngine
from ..engine.config import MAX_RUNNING
from ..engine.request_log import open_log
from ..engine.stats import SpecStats
from . import NODE_NAME, diagnostics
from .engine_factory import build_engine, check_files, plan_engine
from .goal_server import SHUTDOWN_STOP_TIMEOUT, STOP_TIMEOUT, GoalServer
from .goals import LogBudget
from .messages import MAX_ECHO, clip, spec_stats_msg
from .parameters import (PARAMETERS, PARAMETERS_BY_NAME, as_declared, check_values, history_path,
                         spec_config_from)

#: Executor threads the node needs: a transition or parameter call, the running goals' execute
#: callbacks (up to queue.max_running), goal/cancel requests and the diagnostics timer must be able
#: to run at once.
MIN_EXECUTOR_THREADS = 3 + MAX_RUNNING
#: Seconds release() waits for the engine to be idle before leaving the freeing of the models to
#: the running step (a step or prompt chunk on a slow, shared CPU can outlast the goals' stop).
CLOSE_TIMEOUT = 5.0
#: The same wait at shutdown, which must end within SHUTDOWN_BOUND (a launch file escalates to
#: SIGTERM and SIGKILL after that): the step then frees the models itself, if it ever ends.
SHUTDOWN_CLOSE_TIMEOUT = 3.0

_SUCCESS = TransitionCallbackReturn.SUCCESS
_FAILURE = TransitionCallbackReturn.FAILURE


class GemmaSpecNode(LifecycleNodeMixin, Node):
    """Lifecycle node serving ``~/generate`` (gemma_spec_msgs/action/Generate) and ``~/generate_chat``
    (gemma_spec_msgs/action/GenerateChat: chat turns with tool calls) with speculation.

    Topics: ``/diagnostics`` (DiagnosticArray), ``~/spec_stats`` (SpecStats of each finished
    request), ``~/spec_stats_rolling`` (the engine's lifetime SpecStats every diagnostics.period).
    Parameters: see :mod:`gemma_spec_ros.node.parameters` and docs/parameters.md.

    Built as rclpy's own ``LifecycleNode`` is (``Node`` + ``LifecycleNodeMixin``, the same on Humble's
    rclpy 3.3 and Jazzy's 7.1), but with ``callback_group``, which ``LifecycleNode.__init__`` does
    not pass on: its lifecycle services would share the node's default mutually exclusive group with
    the parameter services, and ``ros2 lifecycle get`` / ``ros2 param get`` would hang for as long
    as configure loads the models.
    """

    def __init__(self, node_name: str = NODE_NAME, **kwargs: Any) -> None:
        self._engine: Optional[GenerationEngine] = None
        self._model_info: Dict[str, Any] = {}
        self._stats_pub: Optional[LifecyclePublisher] = None
        self._rolling_pub: Optional[LifecyclePublisher] = None
        self._diag_timer: Optional[Timer] = None
        # the lifecycle state (or transition state) for diagnostics and messages
        self._state = "unconfigured"
        self._configure_error = ""
        self._log_lock = threading.Lock()  # self._requests: goals end and diagnostics read at once
        # release() from a transition and from serve's shutdown path at once: one undoes configure,
        # the other finds nothing left to undo
        self._release_lock = threading.Lock()
        self._requests = diagnostics.RequestLog()
        self._refusal_log = LogBudget()  # refused parameter changes: a peer looping must not fill the disk
        self._transition_lock = threading.Lock()  # one transition at a time (see _change_state)
        Node.__init__(self, node_name, **kwargs)
        LifecycleNodeMixin.__init__(self, callback_group=ReentrantCallbackGroup())
        self._answer_change_state = self._service_change_state.callback
        self._service_change_state.callback = self._change_state

        self._group = ReentrantCallbackGroup()
        self._goals = GoalServer(self, values=self._values, state=lambda: self._state,
                                 report_fault=self._report_fault, rejected=self._goal_rejected,
                                 ended=self._goal_ended)
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
            line = self._refusal_log.line(f"parameter change refused: {reason}", "refusals")
            if line:
                self.get_logger().warning(line)
            return SetParametersResult(successful=False, reason=reason)
        if "diagnostics.period" in changes and self._diag_timer is not None:
            self._diag_timer.timer_period_ns = int(changes["diagnostics.period"] * 1e9)
        return SetParametersResult(successful=True)

    def _check_changes(self, changes: Dict[str, Any]) -> str:
        """'' if the changes can be accepted in the current state, else the reason."""
        if any(value is None for value in changes.values()):
            return "the node's parameters cannot be undeclared"
        if self._state == "configuring":  # it has read the values it builds the engine from
            return "the node is configuring (loading the models): set parameters once it is inactive"
        frozen = sorted(n for n in changes if PARAMETERS_BY_NAME[n].configure_time)
        if frozen and self._engine is not None:
            return (f"{', '.join(frozen)} can only change while unconfigured (the node is "
                    f"{self._state}; the models are loaded): run the cleanup transition first")
        return check_values({**self._values(), **changes}, configured=self._engine is not None)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _change_state(self, request: ChangeState.Request,
                      response: ChangeState.Response) -> ChangeState.Response:
        """The ``~/change_state`` service: rclpy's, one request at a time, never raising.

        The lifecycle services run in a reentrant group (so that ``~/get_state`` answers during a
        transition); a second request while a transition runs is refused (rcl's state machine
        has no transition from a transition state anyway). A transition the current state does
        not have makes rclpy raise RCLError inside the callback, which would stop the executor,
        and the node with it (``ros2 lifecycle set configure`` on an active node did): refused too.
        """
        transition = request.transition.label or str(request.transition.id)
        if not self._transition_lock.acquire(blocking=False):
            self.get_logger().warning(f"transition {transition} refused: the node is {self._state} "
                                      "(one transition at a time)")
            response.success = False
            return response
        try:
            return self._answer_change_state(request, response)
        except Exception as exc:  # noqa: BLE001  an exception here would stop the executor
            self.get_logger().warning(f"transition {transition} refused in state {self._state}: {exc}")
            response.success = False
            return response
        finally:
            self._transition_lock.release()

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Check every path, load the models and create the action server; FAILURE (logged) if a
        file is unusable."""
        self._state = "configuring"
        try:
            return self._configure()
        finally:
            if self._state == "configuring":
                self._state = "unconfigured"

    def _configure(self) -> TransitionCallbackReturn:
        values = self._values()  # construction-time values (YAML, launch) bypass the callback
        reason = check_values(values, configured=False)
        if reason:
            return self._configure_failed(f"invalid parameters: {reason}")
        plan = plan_engine(values)
        remote, files = plan.remote is not None, plan.describe()
        try:  # before any model loads: a 4 GB target must not load for a missing draft or folder
            for folder in check_files(plan):
                self.get_logger().info(f"created {folder} (mode 0700) for the learned caches")
        except Exception as exc:  # noqa: BLE001
            return self._configure_failed(f"cannot {'use' if remote else 'load'} {files}: {exc}")
        try:  # the request log (traffic.*): a file at its path that is not the log's fails here, untouched
            traffic = open_log(values["traffic.log_path"], values["traffic.max_bytes"], values["lookup.cache_dir"],
                               target=plan.describe(), others=(values["lookup.dynamic_path"], self._history_path()))
        except Exception as exc:  # noqa: BLE001
            return self._configure_failed(f"cannot keep the request log: {exc}")
        self.get_logger().info(f"configuring: {'loading' if plan.loads_models else 'using'} {files}")
        started = time.monotonic()
        try:
            engine = build_engine(plan)
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
                + ("fall back to the local model" if plan.fallback_local else "fail until it answers"))
        self._model_info = dict(engine.model_info())
        self._configure_error = ""
        self._stats_pub = self.create_lifecycle_publisher(SpecStatsMsg, "~/spec_stats", 10)
        self._rolling_pub = self.create_lifecycle_publisher(SpecStatsMsg, "~/spec_stats_rolling", 10)
        self._goals.open(engine, values["queue.result_timeout"])
        self._goals.traffic = traffic
        self._state = "inactive"
        mode = f"backend remote ({status['server']})" if remote else f"spec.mode={plan.config.spec.mode}"
        self.get_logger().info(
            f"configured in {time.monotonic() - started:.1f} s: {mode}, n_ctx={engine.n_ctx}")
        return _SUCCESS

    def _configure_failed(self, reason: str) -> TransitionCallbackReturn:
        self._configure_error = reason
        self.get_logger().error(f"configure failed: {reason}")
        return _FAILURE

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Accept goals from now on."""
        self._goals.activate()
        self._state = "active"
        self.get_logger().info("active: accepting goals on ~/generate and ~/generate_chat")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Refuse new goals; stop the running one at its next step; end the waiting ones."""
        self._state = "deactivating"
        self._goals.stop("the node was deactivated")
        self._state = "inactive"
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Free the models (saving the dynamic n-gram cache) and the ROS entities of configure."""
        self._state = "cleaningup"
        self.release("the node was cleaned up")
        self._state = "unconfigured"
        return _SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """From any state: stop goals, free everything, save the dynamic cache (with the shorter
        waits of a shutdown)."""
        self._state = "shuttingdown"
        self.release("the node is shutting down", stop_timeout=SHUTDOWN_STOP_TIMEOUT,
                     close_timeout=SHUTDOWN_CLOSE_TIMEOUT)
        self._state = "finalized"
        return _SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised: release everything and go back to unconfigured."""
        self.get_logger().error(f"error during a transition from {state.label}; releasing the engine")
        self._state = "errorprocessing"
        self.release("the node hit an error")
        self._state = "unconfigured"
        return _SUCCESS

    def release(self, reason: str, stop_timeout: float = STOP_TIMEOUT,
                close_timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop goals and undo configure (free the models, save the dynamic cache). Idempotent.

        What cleanup and shutdown do; callable directly when no transition can run. Waits up to
        ``stop_timeout`` for the running goal to stop and ``close_timeout`` for the engine to be idle.
        """
        with self._release_lock:
            self._release(reason, stop_timeout, close_timeout)

    def _release(self, reason: str, stop_timeout: float, close_timeout: float) -> None:
        self._goals.close(reason, stop_timeout)
        for publisher in (self._stats_pub, self._rolling_pub):
            if publisher is not None:
                self.destroy_lifecycle_publisher(publisher)
        engine, self._engine = self._engine, None
        self._stats_pub = self._rolling_pub = None
        self._model_info = {}
        if engine is not None:
            cache, history = self._value("lookup.dynamic_path"), self._history_path()
            try:
                freed = engine.close(timeout=close_timeout)
            except Exception as exc:  # noqa: BLE001  the models are freed; the save failed
                also = f" (or the suffix history to {history})" if history else ""
                self._report_fault(f"dynamic n-gram cache not saved to {cache}{also}: {exc!r}")
                return
            if not freed:  # never free under a running llama_decode: the step frees it when done
                self.get_logger().warning(
                    f"a generation step is still running {close_timeout:.0f} s after {reason}: the "
                    "engine frees the models (and saves the dynamic n-gram cache) when that step ends")
                return
            self.get_logger().info("engine closed: models freed"
                                   + (f", dynamic n-gram cache saved to {cache}" if cache else "")
                                   + (f", suffix history saved to {history}" if history else ""))

    def _history_path(self) -> str:
        """The suffix history's file as the engine names it ('' = none)."""
        try:
            return history_path(self._value("suffix.history_path"), self._value("lookup.cache_dir"))
        except ValueError:  # no engine was built from it
            return ""

    def _report_fault(self, text: str) -> None:
        """An internal error: logged as ERROR and shown on /diagnostics ("last internal error")."""
        self.get_logger().error(text)
        with self._log_lock:
            self._requests.fault(text)

    def _goal_rejected(self, reason: str) -> None:
        with self._log_lock:
            self._requests.reject(reason)

    def _goal_ended(self, result: Generate.Result, latency: float, stats: Optional[SpecStats]) -> None:
        with self._log_lock:
            self._requests.record(result.finish_reason, latency, stats, result.error)
        if stats is not None and self._stats_pub is not None:
            self._stats_pub.publish(result.stats)

    @property
    def lifecycle_state(self) -> str:
        """unconfigured | inactive | active | finalized, or the transition state running
        (configuring, deactivating, ...)."""
        return self._state

    @property
    def transition_lock(self) -> threading.Lock:
        """Held while a transition runs; whoever triggers one in-process (``trigger_*``) takes it
        too, so that it never runs beside one the ``~/change_state`` service started."""
        return self._transition_lock

    @property
    def configure_error(self) -> str:
        """Why the last configure failed ('' if it did not)."""
        return self._configure_error

    # -- diagnostics -------------------------------------------------------------------------------
    def _view(self) -> diagnostics.NodeView:
        engine = self._engine
        return diagnostics.NodeView(
            node_name=self.get_name(),
            hardware_id=clip(diagnostics.hardware_id(self._value("diagnostics.hardware_id")), 64),
            lifecycle_state=self._state, queue_depth=self._goals.depth(),
            queue_max_depth=self._value("queue.max_depth"), running=self._goals.running(),
            dispatcher=self._goals.dispatcher_state(),
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
                self._rolling_pub.publish(spec_stats_msg(rolling, stamp))
        except Exception as exc:  # noqa: BLE001  e.g. the engine closed during this tick
            self.get_logger().warning(f"diagnostics skipped: {exc!r}", throttle_duration_sec=10.0)
