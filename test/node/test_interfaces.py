"""The generated interfaces of gemma_spec_msgs import and travel over real rclpy/DDS.

The server and the client live in two rclpy contexts (two DDS participants that discover each other
over loopback: conftest.py sets ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and a per-session domain).
"""
from __future__ import annotations

import math
import threading
import time
from typing import Iterator, List, Tuple

import pytest
import rclpy
from action_msgs.msg import GoalStatus
from builtin_interfaces.msg import Time
from rclpy.action import ActionClient, ActionServer, GoalResponse
from rclpy.action.server import ServerGoalHandle
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.context import Context
from rclpy.executors import Executor, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.task import Future
from std_msgs.msg import Header

from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import SpecStats

ACTION = "generate"
FEEDBACK_TEXTS = ("Hel", "lo, ", "w\u00f6rld")


def spec_stats() -> SpecStats:
    """A SpecStats with every field set to a distinct, non-default value."""
    return SpecStats(
        header=Header(stamp=Time(sec=1_700_000_000, nanosec=5), frame_id="unused"),
        spec_mode="auto(lookup)", verification="rejection", draft_max=6, draft_last=4,
        num_drafts=10, num_draft_tokens=40, num_accepted_tokens=25, num_generated_tokens=37,
        num_steps=12, acceptance_rate=25 / 40, mean_acceptance_length=1 + 25 / 10,
        acceptance_per_position=[0.9, 0.7, 0.5, 0.4], acceptance_histogram=[2, 3, 1, 0, 4],
        num_lookup_draft_tokens=20, num_lookup_accepted_tokens=11, num_suffix_draft_tokens=8,
        num_suffix_accepted_tokens=6, num_model_draft_tokens=9, num_model_accepted_tokens=5,
        num_grammar_draft_tokens=3, num_grammar_accepted_tokens=3, num_grammar_cut_tokens=7,
        num_grammar_sole_rows=2,
        tokens_per_second=41.5, time_to_first_token_ms=120.25, prompt_ms=80.5, draft_ms=12.0,
        verify_ms=300.75, sample_ms=4.5, predicted_speedup=1.6, measured_speedup=1.45,
    )


def goal() -> Generate.Goal:
    return Generate.Goal(
        prompt="Say hello.", system_prompt="You are a robot.", use_chat_template=True,
        max_tokens=32, temperature=0.5, top_p=0.875, top_k=40, seed=1234,
        stop=["\n\n", "END"], spec_mode="draft+lookup",
    )


def result() -> Generate.Result:
    return Generate.Result(
        text="".join(FEEDBACK_TEXTS), finish_reason="stop", prompt_tokens=7,
        completion_tokens=len(FEEDBACK_TEXTS), spec_mode="draft+lookup", stats=spec_stats(),
        error="",
    )


def feedback(i: int) -> Generate.Feedback:
    return Generate.Feedback(
        text=FEEDBACK_TEXTS[i], completion_tokens=i + 1, mean_acceptance_length=1.5 + i,
        tokens_per_second=10.0 * (i + 1), spec_mode="draft+lookup", draft_max=4 + i,
    )


def wait_for(future: Future, timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while not future.done():
        assert time.monotonic() < deadline, "timed out waiting for a future"
        time.sleep(0.01)
    return future.result()


class GenerateServer(Node):
    """Minimal action server: checks nothing, records the goal, streams FEEDBACK_TEXTS."""

    def __init__(self, context: Context) -> None:
        self.received: List[Generate.Goal] = []
        super().__init__("generate_server", context=context)
        self._server = ActionServer(
            self, Generate, ACTION, execute_callback=self.execute,
            goal_callback=lambda request: GoalResponse.ACCEPT,
            callback_group=ReentrantCallbackGroup())

    def execute(self, goal_handle: ServerGoalHandle) -> Generate.Result:
        self.received.append(goal_handle.request)
        # Volatile feedback is only delivered to a subscription this side has matched already.
        deadline = time.monotonic() + 10.0
        while (self.count_subscribers(f"/{ACTION}/_action/feedback") < 1
               and time.monotonic() < deadline):
            time.sleep(0.01)
        for i in range(len(FEEDBACK_TEXTS)):
            goal_handle.publish_feedback(feedback(i))
        goal_handle.succeed()
        return result()


def spin_in_thread(executor: Executor, node: Node) -> threading.Thread:
    executor.add_node(node)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def server_and_client() -> Iterator[Tuple[GenerateServer, ActionClient]]:
    contexts = [Context(), Context()]
    for context in contexts:
        rclpy.init(context=context)
    nodes: List[Node] = []
    spinning: List[Tuple[Executor, threading.Thread]] = []
    try:
        server = GenerateServer(contexts[0])
        client_node = Node("generate_client", context=contexts[1])
        nodes += [server, client_node]
        for executor, node in ((MultiThreadedExecutor(num_threads=2, context=contexts[0]), server),
                               (SingleThreadedExecutor(context=contexts[1]), client_node)):
            spinning.append((executor, spin_in_thread(executor, node)))
        client = ActionClient(client_node, Generate, ACTION)
        yield server, client
        client.destroy()
    finally:
        for executor, thread in spinning:
            executor.shutdown(timeout_sec=5.0)
            thread.join(timeout=5.0)
        for node in nodes:
            node.destroy_node()
        for context in contexts:
            rclpy.try_shutdown(context=context)


def test_messages_import_with_the_documented_fields() -> None:
    fields = SpecStats.get_fields_and_field_types()
    for name in ("header", "spec_mode", "draft_max", "num_drafts", "num_draft_tokens",
                 "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                 "acceptance_per_position", "tokens_per_second", "time_to_first_token_ms",
                 "draft_ms", "verify_ms", "predicted_speedup", "measured_speedup"):
        assert name in fields, name
    assert fields["acceptance_per_position"] == "sequence<double>"
    # vLLM's per-request summary: rqt_plot plots the scalars and the histogram's cells (field[i])
    assert fields["acceptance_histogram"] == "sequence<uint64>"
    for kind in ("lookup", "suffix", "model", "grammar"):
        assert fields[f"num_{kind}_draft_tokens"] == fields[f"num_{kind}_accepted_tokens"] == "uint64"
    assert fields["num_grammar_sole_rows"] == fields["num_grammar_cut_tokens"] == "uint64"
    assert Generate.Result.get_fields_and_field_types()["stats"] == "gemma_spec_msgs/SpecStats"
    assert Generate.Goal.get_fields_and_field_types()["stop"] == "sequence<string>"
    default = Generate.Goal()
    assert (default.prompt, default.max_tokens, list(default.stop), default.spec_mode) == (
        "", 0, [], "")


@pytest.mark.timeout(60)
def test_goal_feedback_and_result_round_trip(
        server_and_client: Tuple[GenerateServer, ActionClient]) -> None:
    server, client = server_and_client
    assert client.wait_for_server(timeout_sec=20.0), "action server not discovered"
    received_feedback: List[Generate.Feedback] = []
    goal_handle = wait_for(client.send_goal_async(
        goal(), feedback_callback=lambda message: received_feedback.append(message.feedback)))
    assert goal_handle.accepted
    response = wait_for(goal_handle.get_result_async())
    assert response.status == GoalStatus.STATUS_SUCCEEDED

    assert server.received == [goal()]
    got = response.result
    assert list(got.stats.acceptance_per_position) == [0.9, 0.7, 0.5, 0.4]
    assert list(got.stats.acceptance_histogram) == [2, 3, 1, 0, 4]
    assert (got.stats.num_suffix_draft_tokens, got.stats.num_grammar_sole_rows) == (8, 2)
    assert got == result()
    assert math.isclose(got.stats.mean_acceptance_length, 3.5)

    deadline = time.monotonic() + 5.0  # feedback and result travel on different topics
    while len(received_feedback) < len(FEEDBACK_TEXTS) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received_feedback == [feedback(i) for i in range(len(FEEDBACK_TEXTS))]
    assert "".join(f.text for f in received_feedback) == got.text


def test_spec_stats_message_carries_the_histogram_and_the_tokens_by_source() -> None:
    """The one mapping SpecStats -> message (node/messages.py): every field but the header from
    ``as_dict``, the histogram as integers, the drafters' tokens summed by kind of source."""
    from gemma_spec_ros.engine.stats import SpecStats as Stats
    from gemma_spec_ros.node.messages import spec_stats_msg

    stats = Stats(num_grammar_sole_rows=4, num_grammar_cut_tokens=2)
    stats.observe_draft(4, 4, "lookup")
    stats.observe_draft(4, 1, "eagle3", num_forced=1)
    stats.observe_draft(2, 0, "draft")
    stats.observe_draft(3, 2, "suffix")
    msg = spec_stats_msg(stats, Time(sec=3))
    assert list(msg.acceptance_histogram) == [1, 1, 1, 0, 1] == stats.acceptance_histogram
    assert all(isinstance(n, int) for n in msg.acceptance_histogram)
    assert (msg.num_lookup_draft_tokens, msg.num_lookup_accepted_tokens) == (4, 4)
    assert (msg.num_model_draft_tokens, msg.num_model_accepted_tokens) == (5, 0)  # eagle3 3 + draft 2
    assert (msg.num_suffix_draft_tokens, msg.num_suffix_accepted_tokens) == (3, 2)
    assert (msg.num_grammar_draft_tokens, msg.num_grammar_accepted_tokens) == (1, 1)
    assert (msg.num_grammar_sole_rows, msg.num_grammar_cut_tokens) == (4, 2)
    assert sum(msg.acceptance_histogram) == msg.num_drafts == 4
    assert sum(i * n for i, n in enumerate(msg.acceptance_histogram)) == msg.num_accepted_tokens == 7
    assert msg.num_draft_tokens == sum(getattr(msg, f"num_{kind}_draft_tokens")
                                       for kind in ("lookup", "suffix", "model", "grammar"))
    assert list(spec_stats_msg(Stats(), Time()).acceptance_histogram) == []
