"""Several goals at once (queue.max_running 3), on real rclpy over loopback DDS and the embedded
model: goals stream together, and cancel, preemption, budgets and deactivate hit only their goal;
every goal gets one result; /diagnostics shows the goals running and the passes they share.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator

import pytest
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import GoalRun, key_values, wait_until
from support.node import ServedNode, node_factory

PROMPTS = ("A robot arm picks up a red cube and", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "The three laws of robotics are")
_names = itertools.count()


@pytest.fixture(scope="module")
def served(ros: None, embedded_model_path: Any) -> Iterator[ServedNode]:
    with node_factory() as make_node:
        yield make_node(f"gemma_spec_goals_{next(_names)}", {
            "target.model_path": str(embedded_model_path), "target.n_ctx": 2048, "queue.max_running": 3,
            "queue.max_depth": 8, "spec.mode": "lookup", "limits.max_tokens": 2048,
            "diagnostics.period": 0.2})


def send(served: ServedNode, prompt: str, max_tokens: int, **fields: Any) -> GoalRun:
    run = served.client.send(prompt=prompt, max_tokens=max_tokens, temperature=0.0, **fields)
    assert run.accepted
    return run


def streaming(run: GoalRun) -> GoalRun:
    """``run`` once its first text came back (it runs)."""
    wait_until(lambda: any(f.text for f in run.feedback), 120, "the goal's first text")
    return run


def test_three_goals_stream_at_once_and_each_gets_its_result(served: ServedNode) -> None:
    runs = [send(served, prompt, 64) for prompt in PROMPTS]
    results = [run.wait_result(timeout=300) for run in runs]
    for run, result in zip(runs, results):
        assert run.status == GoalStatus.STATUS_SUCCEEDED and result.finish_reason == "length"
        assert "".join(f.text for f in run.feedback) == result.text
    # each goal's text began before any other goal had its result: they ran at the same time
    first_texts = [min(at for at, f in zip(run.feedback_at, run.feedback) if f.text) for run in runs]
    assert max(first_texts) < min(run.result_at for run in runs)


def test_a_cancel_stops_only_its_goal(served: ServedNode) -> None:
    runs = [streaming(send(served, PROMPTS[0], 1500))] + [send(served, p, 48) for p in PROMPTS[1:]]
    served.client.cancel(runs[0])
    cancelled = runs[0].wait_result(timeout=60)
    assert runs[0].status == GoalStatus.STATUS_CANCELED and cancelled.finish_reason == "cancelled"
    for run in runs[1:]:
        assert run.wait_result(timeout=300).finish_reason == "length"
        assert run.status == GoalStatus.STATUS_SUCCEEDED


def test_an_urgent_goal_preempts_the_lowest_running_one_when_all_places_are_taken(served: ServedNode) -> None:
    low = streaming(send(served, PROMPTS[0], 1500, priority=1))
    others = [streaming(send(served, p, 1500, priority=5)) for p in PROMPTS[1:]]
    urgent = send(served, PROMPTS[2], 8, priority=9, preempt=True)
    stopped = low.wait_result(timeout=60)
    assert stopped.finish_reason == "preempted" and "priority 9" in stopped.error
    assert urgent.wait_result(timeout=120).finish_reason == "length"
    for run in others:  # they kept running: the urgent goal took the preempted one's place
        assert run.result is None
        served.client.cancel(run)
        assert run.wait_result(timeout=60).finish_reason == "cancelled"


def test_a_time_budget_ends_only_its_goal(served: ServedNode) -> None:
    budgeted = send(served, PROMPTS[0], 1500, time_budget=1.0)
    runs = [send(served, p, 32) for p in PROMPTS[1:]]
    result = budgeted.wait_result(timeout=60)
    assert result.finish_reason == "timeout" and budgeted.status == GoalStatus.STATUS_ABORTED
    for run in runs:
        assert run.wait_result(timeout=300).finish_reason == "length"


def test_diagnostics_show_the_goals_running_and_the_passes_they_share(served: ServedNode) -> None:
    runs = [streaming(send(served, p, 1500)) for p in PROMPTS]
    status = served.client.wait_status(
        served.status_name, lambda s: key_values(s).get("requests running") == "3 of 3", timeout=30)
    values = key_values(status)
    assert float(values["requests per pass"]) > 1.0
    assert "measured at load" in values["requests at once"]
    for run in runs:
        served.client.cancel(run)
        run.wait_result(timeout=60)


def test_deactivate_ends_every_running_goal_and_the_node_serves_again(served: ServedNode) -> None:
    client = served.client
    runs = [streaming(send(served, p, 1500)) for p in PROMPTS]
    assert client.transition("deactivate")
    for run in runs:
        result = run.wait_result(timeout=60)
        assert result.finish_reason == "cancelled" and run.status == GoalStatus.STATUS_ABORTED
        assert "deactivat" in result.error
    assert client.transition("activate")
    again = [send(served, p, 16) for p in PROMPTS]
    for run in again:
        assert run.wait_result(timeout=300).finish_reason == "length"


def test_max_running_is_read_by_configure_and_refused_while_configured(served: ServedNode) -> None:
    """It sizes the target's context (a sequence per goal): a change waits for cleanup."""
    [refused] = served.client.set_parameters(queue__max_running=2)
    assert not refused.successful and "cleanup" in refused.reason
    assert served.client.get_parameters(["queue.max_running"])["queue.max_running"] == 3
