"""GenerateClient when rclpy's ActionClient loses a goal response (ros2/rclpy#1123), on real rclpy.

The race: the ActionClient registers a goal request only after sending it, and a response its
executor takes in between is dropped; the request's future never completes although the server
accepted the goal and runs it. No test can time that thread race on demand, so it is INJECTED: the
client's ``send_goal_async`` sends the goal to the real node as usual but hands back a future that
never completes, exactly what the race leaves. The node, its action server and its status topic are
real (tiny GGUF model).
"""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from action_msgs.msg import GoalStatus
from rclpy.task import Future

from gemma_spec_ros.client import GOAL_RESPONSE_GRACE, NoAnswer
from support.node import ServedNode, node_factory
from support.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def served(ros: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedNode]:
    folder = tmp_path_factory.mktemp("lost_response")
    model = write_tiny_gguf(folder / "tiny.gguf", vocab_size=64, seed=3)
    values = {"target.model_path": str(model), "target.n_ctx": 256, "target.n_threads": 1,
              "spec.mode": "lookup", "limits.max_prompt_tokens": 128, "lookup.dynamic_path": "",
              "diagnostics.period": 0.2}
    with node_factory() as serve:
        yield serve("gemma_spec_lost_response", values)


def lose_goal_responses(action_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Goals still reach the server; their responses never reach the caller (see the docstring)."""
    send = action_client.send_goal_async

    def send_and_lose(goal: Any, feedback_callback: Any = None, goal_uuid: Any = None) -> Future:
        send(goal, feedback_callback=feedback_callback, goal_uuid=goal_uuid)
        return Future()

    monkeypatch.setattr(action_client, "send_goal_async", send_and_lose)


@pytest.mark.timeout(120)
def test_an_accepted_goal_whose_response_was_lost_is_found_in_the_status(
        served: ServedNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: send_goal raised NoAnswer after its timeout while the goal ran on the node unseen."""
    client = served.client
    assert client.send(prompt="ab ab", max_tokens=2, temperature=0.0).wait_result() is not None  # discovery done
    lose_goal_responses(client.action, monkeypatch)
    run = client.send(prompt="ab ab ab ab", max_tokens=12, temperature=0.0, timeout=GOAL_RESPONSE_GRACE + 20)
    assert run.accepted and run.response_lost
    result = run.wait_result(timeout=60)
    assert run.status == GoalStatus.STATUS_SUCCEEDED and result.finish_reason in ("stop", "length")
    assert result.completion_tokens > 0 and run.streamed_text == result.text


@pytest.mark.timeout(120)
def test_a_rejected_goal_whose_response_was_lost_times_out_saying_so(
        served: ServedNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejected goal is in no status list: after the timeout, NoAnswer says the server does not
    list it (rejected, or never received)."""
    client = served.client
    lose_goal_responses(client.action, monkeypatch)
    with pytest.raises(NoAnswer, match="does not list the goal"):
        client.send(prompt="ab", max_tokens=2, temperature=0.0, spec_mode="no-such-mode",
                    timeout=GOAL_RESPONSE_GRACE + 3)
