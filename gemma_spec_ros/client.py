"""One blocking ROS client of the gemma_spec node: what ``ros2 lifecycle/param/action/topic`` would do.

Everything goes over the standard interfaces (``~/change_state``, ``~/get_state``,
``~/set_parameters``, the ``~/generate`` action, ``/diagnostics``, ``/rosout``, ``~/spec_stats``);
the client node spins on an executor thread of its own. ``gemma-spec-generate``, the soak, the
bench's ``--via-action`` runner and the node tests all drive the node through this one class.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import SpecStats as SpecStatsMsg
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.msg import Log, SetParametersResult
from rcl_interfaces.srv import SetParameters
from rclpy.action import ActionClient
from rclpy.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import QoSDurabilityPolicy, QoSProfile, QoSReliabilityPolicy

from .node import action_name, spec_status_name  # noqa: F401  spec_status_name: for the client's users

TRANSITIONS = {"configure": Transition.TRANSITION_CONFIGURE,
               "activate": Transition.TRANSITION_ACTIVATE,
               "deactivate": Transition.TRANSITION_DEACTIVATE,
               "cleanup": Transition.TRANSITION_CLEANUP,
               "shutdown": Transition.TRANSITION_UNCONFIGURED_SHUTDOWN}
_SHUTDOWN_FROM = {"inactive": Transition.TRANSITION_INACTIVE_SHUTDOWN,
                  "active": Transition.TRANSITION_ACTIVE_SHUTDOWN}


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.01) -> Any:
    """Poll until ``predicate()`` is truthy; its value, or AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def wait_future(future: Any, timeout: float, what: str) -> Any:
    wait_until(future.done, timeout, what)
    return future.result()


@dataclass
class GoalRun:
    """One goal as a client sees it: acceptance, feedback in order, final status and result."""

    accepted: bool = False
    handle: Any = None
    feedback: List[Any] = field(default_factory=list)
    status: Optional[int] = None
    result: Optional[Any] = None
    _result_future: Any = None

    def wait_feedback(self, count: int = 1, timeout: float = 60.0) -> Any:
        wait_until(lambda: len(self.feedback) >= count, timeout, f"{count} feedback messages")
        return self.feedback[count - 1]

    def wait_result(self, timeout: float = 120.0) -> Any:
        response = wait_future(self._result_future, timeout, "the goal's result")
        self.status, self.result = response.status, response.result
        return self.result

    @property
    def streamed_text(self) -> str:
        return "".join(f.text for f in self.feedback)


class GenerateClient:
    """A client node of the gemma_spec node at ``node_path`` (e.g. "/gemma_spec")."""

    def __init__(self, node_path: str, name: str = "gemma_spec_client") -> None:
        self.node_path = node_path.rstrip("/")
        self.node = rclpy.create_node(name)
        self.executor = MultiThreadedExecutor(num_threads=2)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self._spinner.start()
        self._change_state = self.node.create_client(ChangeState, f"{self.node_path}/change_state")
        self._get_state = self.node.create_client(GetState, f"{self.node_path}/get_state")
        self._set_parameters = self.node.create_client(SetParameters,
                                                       f"{self.node_path}/set_parameters")
        self.action = ActionClient(self.node, Generate, action_name(self.node_path))
        self._lock = threading.Lock()
        self.diagnostics: List[DiagnosticStatus] = []
        self.logs: List[Log] = []
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 50)
        rosout_qos = QoSProfile(depth=100, reliability=QoSReliabilityPolicy.RELIABLE,
                                durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        self.node.create_subscription(Log, "/rosout", self._on_log, rosout_qos)
        self.spec_stats: List[SpecStatsMsg] = []
        self.spec_stats_rolling: List[SpecStatsMsg] = []
        self.node.create_subscription(SpecStatsMsg, f"{self.node_path}/spec_stats",
                                      lambda m: self._append(self.spec_stats, m), 50)
        self.node.create_subscription(SpecStatsMsg, f"{self.node_path}/spec_stats_rolling",
                                      lambda m: self._append(self.spec_stats_rolling, m), 50)

    def close(self) -> None:
        # stop spinning first: an action client destroyed under a spinning executor makes its
        # thread fail to add the client to the wait set (RCLError in the spin thread)
        self.executor.shutdown(timeout_sec=2.0)
        self._spinner.join(timeout=5.0)
        self.action.destroy()
        self.node.destroy_node()

    # -- services ----------------------------------------------------------------------------------
    def _call(self, client: Any, request: Any, timeout: float = 120.0,
              resend_after: Optional[float] = None) -> Any:
        """The service's response. ``resend_after`` (idempotent services only): send the request
        again every that many seconds until answered; right after discovery DDS can drop the first
        response (the server's reply writer not yet matched to this client; seen in CI with a node
        that had just started)."""
        assert client.wait_for_service(timeout_sec=30.0), f"service {client.srv_name} not available"
        deadline = time.monotonic() + timeout
        while True:
            future = client.call_async(request)
            wait = timeout if resend_after is None else min(resend_after, max(0.1, deadline - time.monotonic()))
            try:
                return wait_future(future, wait, f"{client.srv_name} response")
            except AssertionError:
                client.remove_pending_request(future)
                if resend_after is None or time.monotonic() > deadline:
                    raise

    def state(self) -> str:
        return self._call(self._get_state, GetState.Request(), resend_after=5.0).current_state.label

    def transition(self, name: str) -> bool:
        """Trigger a transition by name; shutdown picks the variant of the current state."""
        transition_id = TRANSITIONS[name]
        if name == "shutdown":
            transition_id = _SHUTDOWN_FROM.get(self.state(), transition_id)
        request = ChangeState.Request(transition=Transition(id=transition_id))
        return self._call(self._change_state, request).success

    def set_parameters(self, **values: Any) -> List[SetParametersResult]:
        """Set parameters one by one (dots in names written as '__'); the results, in order."""
        params = [Parameter(name.replace("__", "."), value=value).to_parameter_msg()
                  for name, value in values.items()]
        return list(self._call(self._set_parameters, SetParameters.Request(parameters=params)).results)

    # -- the action --------------------------------------------------------------------------------
    def send(self, timeout: float = 30.0, **fields: Any) -> GoalRun:
        """Send a Generate goal; returns once it is accepted or rejected."""
        assert self.action.wait_for_server(timeout_sec=30.0), "no ~/generate action server"
        run = GoalRun()
        goal = Generate.Goal(**fields)
        future = self.action.send_goal_async(goal, feedback_callback=lambda m: run.feedback.append(m.feedback))
        run.handle = wait_future(future, timeout, "goal response")
        run.accepted = run.handle.accepted
        if run.accepted:
            run._result_future = run.handle.get_result_async()
        return run

    def cancel(self, run: GoalRun, timeout: float = 30.0) -> Any:
        return wait_future(run.handle.cancel_goal_async(), timeout, "cancel response")

    # -- topics ------------------------------------------------------------------------------------
    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        with self._lock:
            self.diagnostics.extend(msg.status)

    def _on_log(self, msg: Log) -> None:
        with self._lock:
            self.logs.append(msg)

    def _append(self, messages: List[Any], msg: Any) -> None:
        with self._lock:
            messages.append(msg)

    def log_mark(self) -> int:
        """A position in the /rosout history: pass it to :meth:`wait_log` as ``since``."""
        with self._lock:
            return len(self.logs)

    def wait_status(self, name: str, predicate: Callable[[DiagnosticStatus], bool] = lambda s: True,
                    timeout: float = 30.0) -> DiagnosticStatus:
        """The first status named ``name`` that arrives from now on and satisfies ``predicate``."""
        with self._lock:
            start = len(self.diagnostics)

        def find() -> Optional[DiagnosticStatus]:
            with self._lock:
                fresh = self.diagnostics[start:]
            return next((s for s in fresh if s.name == name and predicate(s)), None)

        return wait_until(find, timeout, f"a diagnostic status {name!r}")

    def wait_log(self, needle: str, timeout: float = 30.0, since: int = 0) -> Log:
        """A /rosout message (from any node) whose text contains ``needle``, among those received
        after position ``since`` (:meth:`log_mark`, taken before the action that logs it; 0 = the
        whole history, which /rosout's TRANSIENT_LOCAL durability replays)."""
        def find() -> Optional[Log]:
            with self._lock:
                return next((m for m in self.logs[since:] if needle in m.msg), None)

        return wait_until(find, timeout, f"a log message containing {needle!r}")

    def wait_subscribed(self, timeout: float = 30.0) -> None:
        """Until the node's stats publishers are matched with our subscriptions (DDS discovery);
        a message published before that is lost."""
        for topic in ("spec_stats", "spec_stats_rolling"):
            name = f"{self.node_path}/{topic}"
            wait_until(lambda: self.node.count_publishers(name) > 0, timeout, f"a publisher on {name}")


def key_values(status: DiagnosticStatus) -> Dict[str, str]:
    return {kv.key: kv.value for kv in status.values}


def collect(runs: List[GoalRun]) -> List[Tuple[bool, Optional[str]]]:
    """(accepted, finish_reason) of each run, waiting for the accepted ones' results."""
    return [(run.accepted, run.wait_result().finish_reason if run.accepted else None) for run in runs]
