"""One blocking ROS client of the gemma_spec node: what ``ros2 lifecycle/param/action/topic`` would do.

Everything goes over the standard interfaces (``~/change_state``, ``~/get_state``,
``~/set_parameters``, the ``~/generate`` and ``~/generate_chat`` actions, ``/diagnostics``,
``/rosout``, ``~/spec_stats``); the client node spins on an executor thread of its own.
``gemma-spec-generate``, the soak, the bench's ``--via-action`` runner, the LangChain chat model
(:func:`chat_transport`) and the node tests all drive the node through this one class. A goal goes
to the action of its type (a ``Generate.Goal`` or a ``GenerateChat.Goal``).

Blocking: each call returns when the node has answered, or raises :class:`NoAnswer`. The few hooks
(``on_feedback``, ``on_accepted`` of :meth:`GenerateClient.send_goal`) run on the executor's
threads: they must not block (a cancel from there is :meth:`GoalRun.cancel_async`).

Lost responses. rclpy's ActionClient (Humble's before its late-2025 releases, Jazzy's 7.1 too:
ros2/rclpy#1123) registers a request only after sending it, so a response that its executor takes
in between is dropped ("Ignoring unexpected goal response" / "... result response") and the
request's future never completes. The sending thread loses the GIL at the first bytecode after the
send whenever another thread asked for it during the send, which is likeliest for a large goal (a
conversation of many messages holds the GIL for milliseconds of conversion and DDS write).
:class:`RegisteringActionClient` closes that window: a response is handled only once the request it
answers is registered. What remains for responses lost otherwise (a server destroyed mid-request):
a result is asked for again (:meth:`GoalRun.wait_result`'s ``resend_after``); a goal's id is ours:
when no response came within :data:`GOAL_RESPONSE_GRACE` seconds, the client looks for that id in
the action's status topic, which lists every goal the server accepted; found, the goal counts as
accepted (its result, feedback and cancel work as usual); never found, :meth:`GenerateClient.send_goal`
raises :class:`NoAnswer` at its timeout (rejected or lost: a rejected goal is in no status list).
"""
from __future__ import annotations

import functools
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import rclpy
from action_msgs.msg import GoalStatusArray
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from gemma_spec_msgs.action import Generate, GenerateChat
from gemma_spec_msgs.msg import ChatMessage, ToolCall
from gemma_spec_msgs.msg import SpecStats as SpecStatsMsg
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.msg import Log, SetParametersResult
from rcl_interfaces.srv import GetParameters, SetParameters
from rclpy.action import ActionClient
from rclpy.action.client import ClientGoalHandle
from .executors import MultiThreadedExecutor
from rclpy.parameter import Parameter, parameter_value_to_python
from rclpy.qos import QoSDurabilityPolicy, QoSProfile, QoSReliabilityPolicy
from unique_identifier_msgs.msg import UUID

from .node import action_name, chat_action_name, spec_status_name  # noqa: F401  spec_status_name: for users

TRANSITIONS = {"configure": Transition.TRANSITION_CONFIGURE,
               "activate": Transition.TRANSITION_ACTIVATE,
               "deactivate": Transition.TRANSITION_DEACTIVATE,
               "cleanup": Transition.TRANSITION_CLEANUP,
               "shutdown": Transition.TRANSITION_UNCONFIGURED_SHUTDOWN}
_SHUTDOWN_FROM = {"inactive": Transition.TRANSITION_INACTIVE_SHUTDOWN,
                  "active": Transition.TRANSITION_ACTIVE_SHUTDOWN}


#: Seconds without a goal response after which the client looks for the goal in the action's status
#: (see "Lost responses" above); a response normally takes milliseconds.
GOAL_RESPONSE_GRACE = 5.0
#: Seconds between looks at the status once that grace has passed.
STATUS_POLL = 0.05


class NoAnswer(AssertionError):
    """The node did not answer in time: a service, the action server, a goal's response or result.

    An AssertionError, so that a node test fails with it as with an ``assert``; a rig catches it
    by this name (the soak counts the goal lost)."""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.01) -> Any:
    """Poll until ``predicate()`` is truthy; its value, or :class:`NoAnswer` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise NoAnswer(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def wait_future(future: Any, timeout: float, what: str) -> Any:
    wait_until(future.done, timeout, what)
    return future.result()


class RegisteringActionClient(ActionClient):
    """rclpy's ActionClient with ros2/rclpy#1123 closed (what ros2/rclpy#1308 does in the releases
    that have it): sending a request and registering its future happen under one lock, and a taken
    response is handled only after that lock was free once. A response is taken after its request
    was sent, i.e. inside such a section, so by then its sequence number is registered. Redundant
    with an rclpy that has the fix (not tried against one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._registering = threading.Lock()
        super().__init__(*args, **kwargs)

    def send_goal_async(self, *args: Any, **kwargs: Any) -> Any:
        with self._registering:
            return super().send_goal_async(*args, **kwargs)

    def _cancel_goal_async(self, *args: Any, **kwargs: Any) -> Any:
        with self._registering:
            return super()._cancel_goal_async(*args, **kwargs)

    def _get_result_async(self, *args: Any, **kwargs: Any) -> Any:
        with self._registering:
            return super()._get_result_async(*args, **kwargs)

    async def execute(self, taken_data: Any) -> None:
        with self._registering:  # the request this response answers is registered once it is free
            pass
        await super().execute(taken_data)


def guarded(callback: Callable[..., None], who: str) -> Callable[..., None]:
    """``callback`` with its exceptions printed to stderr, never raised into the executor (whose
    spinning thread would die with it, and every later answer with it)."""
    def call(*args: Any) -> None:
        try:
            callback(*args)
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f"\n{who}: callback failed: {exc!r}\n")
    return call


@dataclass
class GoalRun:
    """One goal as a client sees it: acceptance, feedback in order, final status and result, and
    when each came (``time.monotonic()``, taken in the callbacks that received them)."""

    accepted: bool = False
    handle: Any = None
    feedback: List[Any] = field(default_factory=list)
    feedback_at: List[float] = field(default_factory=list)  # when each feedback message came
    status: Optional[int] = None
    result: Optional[Any] = None
    sent_at: float = 0.0
    accepted_at: float = 0.0  # when the goal response came (accepted or not)
    result_at: float = 0.0
    # the result came only for a re-sent result request (see wait_result's resend_after)
    result_resent: bool = False
    _result_future: Any = None  # the first result request's future
    _on_feedback: Optional[Callable[[Any], None]] = None  # send_goal's on_feedback hook
    _responded: threading.Event = field(default_factory=threading.Event)
    _respond_lock: threading.Lock = field(default_factory=threading.Lock)
    #: the goal came as accepted from the action's status, its response having been lost
    response_lost: bool = False
    _finished: threading.Event = field(default_factory=threading.Event)

    def wait_feedback(self, count: int = 1, timeout: float = 60.0) -> Any:
        wait_until(lambda: len(self.feedback) >= count, timeout, f"{count} feedback messages")
        return self.feedback[count - 1]

    def wait_result(self, timeout: Optional[float] = 120.0, resend_after: Optional[float] = None) -> Any:
        """The goal's result; :class:`NoAnswer` after ``timeout`` seconds (None: wait for ever).

        ``resend_after``: every that many seconds without the result, request it again. rclpy's
        ActionClient drops a result response that arrives before ``get_result_async`` registered
        its request (ros2/rclpy#1123; its log says "Ignoring unexpected result response"), and the
        node keeps a finished goal's result for queue.result_timeout (60 s) and answers every
        request, so a client that asks again still gets it. The first answer wins."""
        if not self.accepted:
            raise ValueError("the goal was not accepted: it has no result")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            waits = [w for w in (left, resend_after) if w is not None]
            if self._finished.wait(min(waits) if waits else None):
                return self.result
            if deadline is not None and time.monotonic() >= deadline:
                raise NoAnswer(f"timed out after {timeout:.0f} s waiting for the goal's result")
            self._request_result(resent=True)

    def cancel_async(self) -> Any:
        """Ask the node to cancel the goal without waiting: the future of the CancelGoal response.
        For the hooks, which run on the executor's threads and must not block."""
        return self.handle.cancel_goal_async()

    def _on_response(self, future: Any, on_accepted: Optional[Callable[["GoalRun"], None]]) -> None:
        self._responded_with(future.result(), on_accepted)

    def _responded_with(self, handle: Any, on_accepted: Optional[Callable[["GoalRun"], None]]) -> None:
        """The goal's handle, from its response or from the status (the first of the two wins)."""
        with self._respond_lock:
            if self._responded.is_set():
                return
            self.handle = handle
            self.accepted_at = time.monotonic()
            self.accepted = bool(handle.accepted)
            if self.accepted:
                if on_accepted is not None:  # before the result request: a cancel from here goes first
                    on_accepted(self)
                self._result_future = self._request_result(resent=False)
            self._responded.set()

    def _request_result(self, resent: bool) -> Any:
        future = self.handle.get_result_async()
        future.add_done_callback(guarded(lambda done: self._on_result(done, resent), "GoalRun"))
        return future

    def _on_result(self, future: Any, resent: bool) -> None:
        response = future.result()
        if self._finished.is_set():  # a re-sent request answered too: the same result
            return
        self.result_at = time.monotonic()
        self.result_resent = resent
        self.status, self.result = response.status, response.result
        self._finished.set()

    @property
    def streamed_text(self) -> str:
        return "".join(f.text for f in self.feedback)


class GenerateClient:
    """A client node of the gemma_spec node at ``node_path`` (e.g. "/gemma_spec").

    ``keep_history``: keep every message of /diagnostics, /rosout and the stats topics in lists
    (what the node tests read). A long-running client passes False: it then subscribes to
    /diagnostics only and keeps the latest status of each name (:meth:`latest_status`), so that
    its memory does not grow with the run. ``threads``: of the client's executor."""

    def __init__(self, node_path: str, name: str = "gemma_spec_client", keep_history: bool = True,
                 threads: int = 2) -> None:
        self.node_path = node_path.rstrip("/")
        self.node = rclpy.create_node(name)
        self.executor = MultiThreadedExecutor(num_threads=threads)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self._spinner.start()
        self._change_state = self.node.create_client(ChangeState, f"{self.node_path}/change_state")
        self._get_state = self.node.create_client(GetState, f"{self.node_path}/get_state")
        self._get_parameters = self.node.create_client(GetParameters,
                                                       f"{self.node_path}/get_parameters")
        self._set_parameters = self.node.create_client(SetParameters,
                                                       f"{self.node_path}/set_parameters")
        self.action = RegisteringActionClient(self.node, Generate, action_name(self.node_path))
        self.chat_action = RegisteringActionClient(self.node, GenerateChat, chat_action_name(self.node_path))
        self._lock = threading.Lock()
        # Feedback comes from a subscription of our own, not the ActionClient's feedback callback:
        # rclpy forgets a goal's feedback callback when its result arrives, and the result (a
        # service response) can overtake the last feedback message (a topic), which was then lost.
        # Keyed by goal id; a run its caller has dropped gets no more feedback. A deep queue: a
        # burst of one-token steps must not be dropped by the client itself.
        self._runs_by_goal: "weakref.WeakValueDictionary[bytes, GoalRun]" = weakref.WeakValueDictionary()
        # The ids of the goals the server lists as accepted, kept only for goals whose response has
        # not come (see "Lost responses"); the status topic's QoS is the server's (rcl_action's).
        self._listed: Dict[bytes, Any] = {}  # goal id -> its GoalInfo in the server's status
        self._awaiting: Dict[bytes, GoalRun] = {}
        for action_type, name in ((Generate, action_name(self.node_path)),
                                  (GenerateChat, chat_action_name(self.node_path))):
            self.node.create_subscription(action_type.Impl.FeedbackMessage, f"{name}/_action/feedback",
                                          self._on_feedback_message, QoSProfile(depth=1000))
            self.node.create_subscription(GoalStatusArray, f"{name}/_action/status", self._on_status, QoSProfile(
                depth=1, reliability=QoSReliabilityPolicy.RELIABLE, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL))
        self._keep_history = keep_history
        self.diagnostics: List[DiagnosticStatus] = []
        self._latest: Dict[str, DiagnosticStatus] = {}
        self.logs: List[Log] = []
        self.spec_stats: List[SpecStatsMsg] = []
        self.spec_stats_rolling: List[SpecStatsMsg] = []
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 50)
        if keep_history:
            rosout_qos = QoSProfile(depth=100, reliability=QoSReliabilityPolicy.RELIABLE,
                                    durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
            self.node.create_subscription(Log, "/rosout", self._on_log, rosout_qos)
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
        self.chat_action.destroy()
        self.node.destroy_node()

    # -- services ----------------------------------------------------------------------------------
    def _call(self, client: Any, request: Any, timeout: float = 120.0,
              resend_after: Optional[float] = None) -> Any:
        """The service's response. ``resend_after`` (idempotent services only): send the request
        again every that many seconds until answered; right after discovery DDS can drop the first
        response (the server's reply writer not yet matched to this client; seen in CI with a node
        that had just started)."""
        if not client.wait_for_service(timeout_sec=30.0):
            raise NoAnswer(f"service {client.srv_name} not available")
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

    def get_parameters(self, names: Sequence[str]) -> Dict[str, Any]:
        """The parameters' values as Python values, by name (None for one the node has not set)."""
        values = self._call(self._get_parameters, GetParameters.Request(names=list(names))).values
        return {name: parameter_value_to_python(value) for name, value in zip(names, values)}

    # -- the action --------------------------------------------------------------------------------
    def wait_for_server(self, timeout: float = 30.0, chat: bool = False) -> bool:
        """Whether the node's Generate (``chat``: GenerateChat) action server is there (DDS
        discovery) within ``timeout``."""
        return (self.chat_action if chat else self.action).wait_for_server(timeout_sec=timeout)

    def send(self, timeout: float = 30.0, **fields: Any) -> GoalRun:
        """Send a Generate goal made of ``fields``; returns once it is accepted or rejected."""
        return self.send_goal(Generate.Goal(**fields), timeout)

    def send_chat(self, timeout: float = 30.0, **fields: Any) -> GoalRun:
        """Send a GenerateChat goal made of ``fields`` (:func:`chat_goal`: messages as dicts or
        ChatMessage messages); returns once it is accepted or rejected."""
        return self.send_goal(chat_goal(fields), timeout)

    def _action_of(self, goal: Any) -> Tuple[ActionClient, Any, str]:
        """The action client a goal goes to, its action type and its name."""
        if isinstance(goal, GenerateChat.Goal):
            return self.chat_action, GenerateChat, chat_action_name(self.node_path)
        return self.action, Generate, action_name(self.node_path)

    def send_goal(self, goal: Generate.Goal, timeout: Optional[float] = 30.0,
                  on_feedback: Optional[Callable[[Any], None]] = None,
                  on_accepted: Optional[Callable[[GoalRun], None]] = None) -> GoalRun:
        """Send ``goal``; returns once it is accepted or rejected (:class:`NoAnswer` after
        ``timeout`` seconds without a response, None: no limit; or 30 s without an action server).

        Hooks, run on the executor's threads: ``on_feedback(message)`` with each feedback message
        (an rclpy feedback callback's argument: the text is ``message.feedback.text``), after it
        is appended to the run's ``feedback``; ``on_accepted(run)`` in the goal-response callback
        of an accepted goal, before its result is requested."""
        action, action_type, name = self._action_of(goal)
        if not action.wait_for_server(timeout_sec=30.0):
            raise NoAnswer(f"no action server {name}")
        run = GoalRun()
        who = self.node.get_name()

        # the hook only: a closure over the run would tie it to itself and keep it in
        # _runs_by_goal (weak values) until a garbage collection
        run._on_feedback = guarded(on_feedback, who) if on_feedback is not None else None
        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        key = bytes(goal_id.uuid)
        with self._lock:
            self._runs_by_goal[key] = run
            self._awaiting[key] = run
        run.sent_at = time.monotonic()
        accepted_hook = guarded(on_accepted, who) if on_accepted is not None else None
        try:
            future = action.send_goal_async(goal, goal_uuid=goal_id)
            future.add_done_callback(guarded(lambda done: run._on_response(done, accepted_hook), who))
            self._wait_response((action, action_type), run, goal_id, timeout, accepted_hook)
        finally:
            with self._lock:
                self._awaiting.pop(key, None)
                self._listed.pop(key, None)
        return run

    def _wait_response(self, action: Tuple[ActionClient, Any], run: GoalRun, goal_id: UUID,
                       timeout: Optional[float], on_accepted: Optional[Callable[[GoalRun], None]]) -> None:
        """Until the goal's response, or its id in the server's status once
        :data:`GOAL_RESPONSE_GRACE` seconds have passed without one (a lost response: see the
        module docstring); :class:`NoAnswer` after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else run.sent_at + timeout
        while True:
            waited = time.monotonic() - run.sent_at
            wait = STATUS_POLL if waited >= GOAL_RESPONSE_GRACE else GOAL_RESPONSE_GRACE - waited
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            if run._responded.wait(wait):
                return
            with self._lock:
                listed = self._listed.get(bytes(goal_id.uuid))
            if listed is not None and time.monotonic() - run.sent_at >= GOAL_RESPONSE_GRACE:
                self.node.get_logger().warning(
                    "no goal response (lost: ros2/rclpy#1123); the server lists the goal as accepted")
                client, action_type = action
                response = action_type.Impl.SendGoalService.Response(accepted=True, stamp=listed.stamp)
                run.response_lost = True
                run._responded_with(ClientGoalHandle(client, goal_id, response), on_accepted)
            elif deadline is not None and time.monotonic() >= deadline:
                raise NoAnswer(f"timed out after {timeout:.0f} s waiting for the goal response (and "
                               "the server does not list the goal: rejected, or never received)")

    def cancel(self, run: GoalRun, timeout: float = 30.0) -> Any:
        return wait_future(run.handle.cancel_goal_async(), timeout, "cancel response")

    # -- topics ------------------------------------------------------------------------------------
    def _on_status(self, message: GoalStatusArray) -> None:
        with self._lock:
            for status in message.status_list:
                key = bytes(status.goal_info.goal_id.uuid)
                if key in self._awaiting:
                    self._listed[key] = status.goal_info

    def _on_feedback_message(self, message: Any) -> None:
        with self._lock:
            run = self._runs_by_goal.get(bytes(message.goal_id.uuid))
        if run is not None:
            run.feedback_at.append(time.monotonic())
            run.feedback.append(message.feedback)
            if run._on_feedback is not None:
                run._on_feedback(message)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        with self._lock:
            if self._keep_history:
                self.diagnostics.extend(msg.status)
            self._latest.update((status.name, status) for status in msg.status)

    def latest_status(self, name: str) -> Optional[DiagnosticStatus]:
        """The last status named ``name`` received on /diagnostics; None before the first."""
        with self._lock:
            return self._latest.get(name)

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


def chat_goal(fields: Mapping[str, Any]) -> GenerateChat.Goal:
    """A GenerateChat goal from plain fields: ``messages`` as dicts (role, content, name,
    tool_call_id, tool_calls of {id, name, arguments}) or ChatMessage messages; the other fields
    as the goal's."""
    fields = dict(fields)
    messages = [m if isinstance(m, ChatMessage) else ChatMessage(
        role=m["role"], content=m.get("content") or "", name=m.get("name") or "",
        tool_call_id=m.get("tool_call_id") or "",
        tool_calls=[ToolCall(id=c.get("id") or "", name=c["name"], arguments=c.get("arguments") or "{}")
                    for c in m.get("tool_calls") or ()]) for m in fields.pop("messages", ())]
    return GenerateChat.Goal(messages=messages, **fields)


def chat_result_fields(result: GenerateChat.Result) -> Dict[str, Any]:
    """A GenerateChat result as plain fields (what :func:`chat_transport` returns)."""
    message = result.message
    return {"message": {"role": message.role, "content": message.content,
                        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                       for c in message.tool_calls]},
            "finish_reason": result.finish_reason, "error": result.error, "spec_mode": result.spec_mode,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "prompt_tokens_reused": result.stats.num_prompt_tokens_reused}


class TurnRefused(RuntimeError):
    """The node rejected a chat turn (its log and /diagnostics' "last rejection" say why)."""


class ChatTransport:
    """goal fields -> result fields, over the GenerateChat action of the node at ``node_path``
    (rclpy initialised if it is not): each call sends one turn and waits for its result (at most
    ``timeout`` seconds). TurnRefused if the node rejects the goal, NoAnswer if it does not answer.

    :meth:`stream` sends a turn and yields its text as the node streams it, then its result fields.
    :meth:`model_name` is the node's target model (its ``target.model_path``, read once).

    Closing: :meth:`close` stops the client's executor thread and destroys its rclpy node (a
    transport is also a context manager). Every transport still open when the interpreter exits is
    closed then (atexit), and rclpy shut down if a transport initialised it: a process that left
    the client spinning into its teardown could abort ("terminate called without an active
    exception")."""

    #: the transports' clients not closed yet (a transport dropped unclosed too): the exit hook's
    _open: Dict[int, GenerateClient] = {}
    _exit_hook = False  # registered with atexit
    _owns_rclpy = False  # a transport initialised rclpy: the exit hook shuts it down

    def __init__(self, node_path: str, timeout: float = 300.0) -> None:
        self.node_path, self.timeout = node_path, timeout
        self._client: Optional[GenerateClient] = None
        self._model_name: Optional[str] = None
        self._lock = threading.Lock()  # the client's opening and closing
        self._model_lock = threading.Lock()
        self.client  # opened now: discovering the node takes a while

    @property
    def client(self) -> GenerateClient:
        """The ROS client of the node (rclpy initialised if it is not); opened again after
        :meth:`close` when the transport is used again."""
        with self._lock:
            if self._client is None:
                if not rclpy.ok():
                    rclpy.init()
                    ChatTransport._owns_rclpy = True
                self._client = GenerateClient(self.node_path, name=f"gemma_spec_chat_{uuid.uuid4().hex[:8]}",
                                              keep_history=False)
                ChatTransport._open[id(self._client)] = self._client
                if not ChatTransport._exit_hook:
                    import atexit  # noqa: WPS433  only a transport needs it

                    atexit.register(ChatTransport.close_all)
                    ChatTransport._exit_hook = True
            return self._client

    @property
    def closed(self) -> bool:
        """No ROS client open (before the first use after :meth:`close`)."""
        return self._client is None

    def _send(self, fields: Mapping[str, Any], on_feedback: Optional[Callable[[Any], None]] = None) -> GoalRun:
        run = self.client.send_goal(chat_goal(fields), self.timeout, on_feedback=on_feedback)
        if not run.accepted:
            raise TurnRefused(f"{chat_action_name(self.node_path)} rejected the turn (the node's log and "
                              "/diagnostics 'last rejection' say why)")
        return run

    def _result(self, run: GoalRun) -> Dict[str, Any]:
        return chat_result_fields(run.wait_result(self.timeout, resend_after=min(self.timeout, 10.0)))

    def __call__(self, fields: Mapping[str, Any]) -> Dict[str, Any]:
        return self._result(self._send(fields))

    def stream(self, fields: Mapping[str, Any]) -> Any:
        """Send one turn; an iterator of its text as the node streams it (each feedback's ``text``,
        in order, empty ones left out), then of its result fields (a dict, the last item). Feedback
        that comes after the result is not waited for (the result's message has the whole text).
        Leaving the iteration early cancels the goal. TurnRefused / NoAnswer as a call."""
        import queue  # noqa: WPS433

        arrivals: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
        run = self._send(fields, on_feedback=lambda message: arrivals.put(("text", message.feedback.text)))

        def wait() -> None:
            try:
                arrivals.put(("result", self._result(run)))
            except BaseException as exc:  # noqa: BLE001  raised where the caller iterates
                arrivals.put(("error", exc))

        threading.Thread(target=wait, name="gemma_spec_chat_result", daemon=True).start()
        return self._arrivals(run, arrivals)

    @staticmethod
    def _arrivals(run: GoalRun, arrivals: Any) -> Any:
        ended = False
        try:
            while True:
                kind, value = arrivals.get()
                if kind == "error":
                    ended = True
                    raise value
                if kind == "result":
                    ended = True
                    break
                if value:
                    yield value
        finally:
            if not ended:  # the caller stopped iterating: stop the turn
                run.cancel_async()
        while not arrivals.empty():  # feedback that came just before the result's answer
            kind, late = arrivals.get_nowait()
            if kind == "text" and late:
                yield late
        yield value

    def model_name(self) -> str:
        """The node's target model: the file name of its ``target.model_path`` without ``.gguf``,
        read from the node once and kept ('' while the node does not answer; asked again then)."""
        with self._model_lock:
            if self._model_name is None:
                try:
                    path = self.client.get_parameters(["target.model_path"])["target.model_path"]
                except NoAnswer:
                    return ""
                self._model_name = self.model_name_of(str(path or ""))
            return self._model_name

    @staticmethod
    def model_name_of(path: str) -> str:
        """A model's name from its file's path.

        >>> ChatTransport.model_name_of("~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf")
        'gemma-3-270m-q4_k_m'
        """
        name = path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
        return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name

    def close(self) -> None:
        """Stop the client's executor thread and destroy its node (nothing if none is open). A
        later call opens a new client."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            self._close_client(client)

    @classmethod
    def _close_client(cls, client: GenerateClient) -> None:
        if cls._open.pop(id(client), None) is None:
            return  # closed already
        try:
            client.close()
        except Exception:  # noqa: BLE001
            if rclpy.ok():  # rclpy already shut down: its nodes went with it
                raise

    def __enter__(self) -> "ChatTransport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @classmethod
    def close_all(cls) -> None:
        """Close every transport's client still open, then shut rclpy down if a transport
        initialised it (the atexit hook)."""
        for client in list(cls._open.values()):
            try:
                cls._close_client(client)
            except Exception as exc:  # noqa: BLE001  at exit: say so, close the others
                sys.stderr.write(f"closing the chat transport to {client.node_path}: {exc!r}\n")
        if cls._owns_rclpy:
            rclpy.try_shutdown()
            cls._owns_rclpy = False


@functools.lru_cache(maxsize=None)
def chat_transport(node_path: str, timeout: float = 300.0) -> ChatTransport:
    """The process's one :class:`ChatTransport` to the node at ``node_path`` with ``timeout``."""
    return ChatTransport(node_path, timeout)


def key_values(status: DiagnosticStatus) -> Dict[str, str]:
    return {kv.key: kv.value for kv in status.values}


def collect(runs: List[GoalRun]) -> List[Tuple[bool, Optional[str]]]:
    """(accepted, finish_reason) of each run, waiting for the accepted ones' results."""
    return [(run.accepted, run.wait_result().finish_reason if run.accepted else None) for run in runs]
