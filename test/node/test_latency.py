"""Planner latency on the real node (rclpy over loopback, the embedded model): a goal's time budget,
priority order, preemption by an urgent goal, queue positions in feedback, latency on /diagnostics.

One active node serves the module; every test starts from an idle queue and leaves it idle.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterator, List

import pytest
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import GenerateClient, GoalRun, key_values, wait_until
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.node import GemmaSpecNode
from support.node import ServedNode

NODE = "gemma_spec_latency"
SPEC_STATUS = spec_status_name(NODE)
PROMPT = "The inspection robot's hourly log.\nHour 1: corridor clear.\nHour 2:"


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], tmp_path_factory: pytest.TempPathFactory,
           embedded_model_path: Path) -> ServedNode:
    folder = tmp_path_factory.mktemp("latency")
    overrides = {
        "target.model_path": str(embedded_model_path), "target.n_ctx": 1024,
        "lookup.dynamic_path": str(folder / "dynamic.bin"), "lookup.cache_dir": str(folder),
        "spec.mode": "off", "limits.max_tokens": 900, "queue.max_depth": 4,
        "diagnostics.period": 0.2,
    }
    return node_client(NODE, overrides)


@pytest.fixture
def idle(node: GemmaSpecNode, client: GenerateClient) -> Iterator[GenerateClient]:
    """The node's queue is empty before and after the test."""
    wait_until(lambda: not node._goals.busy(), 120, "an idle queue")
    yield client
    wait_until(lambda: not node._goals.busy(), 120, "an idle queue after the test")


def running(run: GoalRun) -> GoalRun:
    """Wait until ``run`` is generating (its first text feedback arrived)."""
    wait_until(lambda: any(f.completion_tokens for f in run.feedback), 60, "the goal to run")
    return run


def positions(run: GoalRun) -> List[int]:
    return [f.queue_position for f in run.feedback if f.queue_position]


@pytest.mark.timeout(240)
def test_time_budget_ends_the_goal_with_timeout_and_its_text(idle: GenerateClient) -> None:
    run = idle.send(prompt=PROMPT, max_tokens=800, time_budget=0.6)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_ABORTED
    assert result.finish_reason == "timeout" and "time_budget" in result.error
    assert 0 < result.completion_tokens < 800 and result.text == run.streamed_text
    status = idle.wait_status(SPEC_STATUS, lambda s: int(key_values(s)["requests timeout"]) >= 1)
    assert float(key_values(status)["TTFT p95 ms"]) > 0


@pytest.mark.timeout(240)
def test_a_waiting_goal_ends_when_its_budget_runs_out_not_when_its_turn_comes(idle: GenerateClient) -> None:
    """N7 (second review): a waiting goal's budget was checked only when it reached the head of
    the queue, so a 1 s goal behind an 800-token one got its timeout after the long goal ended."""
    first = running(idle.send(prompt=PROMPT, max_tokens=800))
    waiting = idle.send(prompt=PROMPT, max_tokens=8, time_budget=1.0)
    result = waiting.wait_result(timeout=30)
    assert result.finish_reason == "timeout" and "while waiting" in result.error
    assert waiting.status == GoalStatus.STATUS_ABORTED and result.completion_tokens == 0
    assert not first._result_future.done()  # the long goal still runs: it was not its turn
    idle.cancel(first)
    assert first.wait_result().finish_reason == "cancelled"


@pytest.mark.timeout(300)
def test_waiting_goals_start_by_priority_and_feedback_their_queue_position(idle: GenerateClient) -> None:
    """A long goal runs; B (priority 0), C (priority 5), D (priority 0) wait: C starts first, then B
    and D in arrival order. Each waiting goal's feedback tracks its position (1 = next)."""
    order: List[str] = []
    first = running(idle.send(prompt=PROMPT, max_tokens=800))
    runs: Dict[str, GoalRun] = {}
    for name, priority in (("B", 0), ("C", 5), ("D", 0)):
        # 24 tokens each: a goal runs long enough that the position feedback sent when it starts
        # reaches the next goal's client before that goal's result does (rclpy's action client
        # drops feedback arriving after the result)
        runs[name] = idle.send(prompt=PROMPT, max_tokens=24, priority=priority)
        runs[name]._result_future.add_done_callback(lambda _, name=name: order.append(name))
    wait_until(lambda: positions(runs["D"]) == [3], 30, "D's queue position")
    idle.cancel(first)
    first.wait_result()
    for run in runs.values():
        assert run.wait_result().finish_reason == "length"
    # rclpy runs a future's done callbacks as executor tasks: the last one may still be pending
    # when wait_result() returns
    wait_until(lambda: len(order) == 3, 10, "every result's done callback")
    assert order == ["C", "B", "D"]
    assert positions(runs["C"]) == [1]
    assert positions(runs["B"]) == [1, 2, 1]  # C arrived ahead of it, then C started
    assert positions(runs["D"]) == [3, 2, 1]


@pytest.mark.timeout(300)
def test_an_urgent_goal_preempts_a_running_routine_one(idle: GenerateClient) -> None:
    routine = running(idle.send(prompt=PROMPT, max_tokens=800, priority=0))
    urgent = idle.send(prompt=PROMPT, max_tokens=6, priority=10, preempt=True)
    stopped = routine.wait_result()
    assert routine.status == GoalStatus.STATUS_ABORTED
    assert stopped.finish_reason == "preempted" and "priority 10" in stopped.error
    assert 0 < stopped.completion_tokens < 800 and stopped.text == routine.streamed_text
    assert urgent.wait_result().finish_reason == "length" and urgent.status == GoalStatus.STATUS_SUCCEEDED
    # preempt only stops lower priorities: an equal one waits its turn
    same = running(idle.send(prompt=PROMPT, max_tokens=60, priority=3))
    polite = idle.send(prompt=PROMPT, max_tokens=4, priority=3, preempt=True)
    assert same.wait_result().finish_reason == "length"
    assert polite.wait_result().finish_reason == "length"
    status = idle.wait_status(SPEC_STATUS, lambda s: int(key_values(s)["requests preempted"]) >= 1)
    assert float(key_values(status)["queue wait p95 ms"]) > 0


@pytest.mark.timeout(240)
def test_a_repeated_prompt_is_reused_and_shown_on_diagnostics(node: GemmaSpecNode, idle: GenerateClient) -> None:
    """The second goal with the same long system prompt evaluates only its new tokens; with
    generation.prompt_cache false the whole prompt is evaluated again."""
    system = "Skills: move_to, pick, place, say. Rules: close doors; report failures. " * 8

    def window_after_one_more(**goal: object) -> Dict[str, int]:
        ok = int(key_values(idle.wait_status(SPEC_STATUS))["requests ok"])
        assert idle.send(**goal).wait_result().finish_reason == "length"
        values = key_values(idle.wait_status(SPEC_STATUS, lambda s: int(key_values(s)["requests ok"]) > ok))
        return {k: int(values[f"prompt tokens {k} (window)"]) for k in ("reused", "evaluated")}

    window_after_one_more(prompt=system + "Task 0: tidy the table.", max_tokens=4)
    before = window_after_one_more(prompt=system + "Task 1: tidy the table.", max_tokens=4)
    reused = window_after_one_more(prompt=system + "Task 2: tidy the table.", max_tokens=4)
    assert reused["reused"] - before["reused"] > 100  # the system prompt (~130 tokens)
    assert 0 < reused["evaluated"] - before["evaluated"] < 20  # only "Task 2: ..." and the last token
    try:  # off: every prompt evaluated whole
        assert all(r.successful for r in idle.set_parameters(generation__prompt_cache=False))
        whole = window_after_one_more(prompt=system + "Task 3: tidy the table.", max_tokens=4)
        assert whole["reused"] == reused["reused"] and whole["evaluated"] - reused["evaluated"] > 100
    finally:
        idle.set_parameters(generation__prompt_cache=True)
    stats = idle.send(prompt=system + "Task 4: tidy the table.", max_tokens=4).wait_result().stats
    assert stats.num_prompt_tokens - 20 < stats.num_prompt_tokens_reused < stats.num_prompt_tokens
    assert stats.queue_wait_ms >= 0.0
