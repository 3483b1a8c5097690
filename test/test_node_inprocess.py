"""The gemma_spec node on real rclpy, driven by another node over the standard interfaces.

One node (real Engine on the embedded model) serves the whole module, so the tests run in file
order along its life: unconfigured (a failed configure, then fixed) -> inactive -> active (goals,
cancel, queue, runtime mode switch, diagnostics, deactivation mid-goal) -> inactive -> unconfigured
-> finalized. Each test states the state it starts from.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Iterator

import pytest
import rclpy
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter

from gemma_spec_ros.engine.types import KVCacheError
from gemma_spec_ros.node.node import MIN_EXECUTOR_THREADS, GemmaSpecNode
from test_node_harness import Client, collect, key_values, wait_until

NODE = "gemma_spec_inprocess"
SPEC_STATUS = f"{NODE}: speculative decoding"
MODELS_STATUS = f"{NODE}: models"
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
MISSING = "/nonexistent/gemma_spec_test/missing-model.gguf"
QUEUE_DEPTH = 2
K = 3


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GemmaSpecNode]:
    """The node under test, unconfigured, with a missing target model; spun on its own executor."""
    rclpy.init()
    overrides = {
        "target.model_path": MISSING, "target.n_ctx": 512,
        "lookup.dynamic_path": str(tmp_path_factory.mktemp("lookup") / "dynamic.bin"),
        # adaptive off: always draft K when the n-gram caches have a continuation, so tau is known
        "spec.mode": "lookup", "spec.draft_max": K, "spec.adaptive": False, "generation.max_tokens": 8,
        "limits.max_tokens": 400, "limits.max_prompt_tokens": 256, "queue.max_depth": QUEUE_DEPTH,
        "diagnostics.period": 0.2,
    }
    gemma = GemmaSpecNode(NODE, parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
    executor = MultiThreadedExecutor(num_threads=MIN_EXECUTOR_THREADS + 2)
    executor.add_node(gemma)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    yield gemma
    gemma.release("test teardown")
    executor.shutdown(timeout_sec=5.0)
    gemma.destroy_node()
    rclpy.try_shutdown()


@pytest.fixture(scope="module")
def client(node: GemmaSpecNode) -> Iterator[Client]:
    ros = Client(f"/{NODE}")
    yield ros
    ros.close()


def long_goal(max_tokens: int = 96) -> dict:
    return dict(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, seed=1)


@pytest.mark.timeout(240)
def test_configure_fails_on_bad_models_then_recovers(client: Client, embedded_model_path: Path,
                                                     other_vocab_model_path: Path) -> None:
    """unconfigured: configure FAILS naming the file (missing target; draft of another vocabulary);
    the paths are fixed with set_parameters; the node configures (inactive) and activates."""
    assert client.state() == "unconfigured"
    assert client.transition("configure") is False
    assert client.state() == "unconfigured"
    client.wait_log(MISSING)
    stale = client.wait_status(SPEC_STATUS)
    assert stale.level == DiagnosticStatus.STALE and MISSING in stale.message

    results = client.set_parameters(target__model_path=str(embedded_model_path),
                                    draft__model_path=str(other_vocab_model_path))
    assert all(r.successful for r in results), results
    assert client.transition("configure") is False
    assert str(other_vocab_model_path) in client.wait_log("cannot draft for target").msg
    assert client.state() == "unconfigured"

    [result] = client.set_parameters(draft__model_path="")
    assert result.successful, result.reason
    assert client.transition("configure") is True
    assert client.state() == "inactive"
    models = key_values(client.wait_status(MODELS_STATUS))
    assert models["target.path"] == str(embedded_model_path)
    assert int(models["target.n_vocab"]) > 0 and "target.size_bytes" in models

    run = client.send(**long_goal(8))
    assert not run.accepted, "an inactive node must reject goals"
    client.wait_log("goal rejected: the node is inactive")

    assert client.transition("activate") is True
    assert client.state() == "active"


@pytest.mark.timeout(120)
def test_invalid_goals_rejected_then_valid_goal_served(client: Client) -> None:
    """active: each invalid field is rejected (the reason is logged); a valid goal still works."""
    invalid = {
        "empty prompt": (dict(prompt=""), "prompt is empty"),
        "negative temperature": (dict(temperature=-0.5), "temperature=-0.5"),
        "NaN temperature": (dict(temperature=math.nan), "temperature=nan"),
        "negative top_p": (dict(top_p=-0.1), "top_p=-0.1"),
        "top_p above 1": (dict(top_p=1.5), "top_p=1.5"),
        "NaN top_p": (dict(top_p=math.nan), "top_p=nan"),
        "negative top_k": (dict(top_k=-2), "top_k=-2"),
        "unknown spec_mode": (dict(spec_mode="warp"), "spec_mode 'warp'"),
        "draft mode without a draft model": (dict(spec_mode="draft"), "needs a draft model"),
        "max_tokens above the cap": (dict(max_tokens=401), "exceeds limits.max_tokens=400"),
        "prompt over max_prompt_tokens": (dict(prompt="robot " * 300), "limits.max_prompt_tokens=256"),
        "prompt + max_tokens over n_ctx": (dict(prompt="robot " * 200, max_tokens=400),
                                           "exceeds the context"),
    }
    for what, (fields, reason) in invalid.items():
        goal = {"prompt": "Hello", "max_tokens": 4, **fields}
        assert not client.send(**goal).accepted, f"{what} was accepted"
        client.wait_log(reason)

    run = client.send(prompt="The robot picked up the", max_tokens=6, seed=3)
    assert run.accepted
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert result.finish_reason in ("length", "stop") and result.completion_tokens >= 1
    assert result.text and result.spec_mode == "lookup" and result.stats.num_generated_tokens >= 1


@pytest.mark.timeout(120)
def test_stream_then_cancel_within_one_step(client: Client) -> None:
    """active: feedback streams whole text; a cancel ends the goal at the next step."""
    run = client.send(**long_goal())
    assert run.accepted
    seen = run.wait_feedback(2)
    client.cancel(run)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_CANCELED
    assert result.finish_reason == "cancelled"
    # One step emits at most K + 1 tokens; the step in flight when the cancel arrived may finish.
    assert result.completion_tokens <= seen.completion_tokens + 2 * (K + 1) < 96
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")


@pytest.mark.timeout(180)
def test_queue_of_depth_n_rejects_the_n_plus_first(client: Client) -> None:
    """active: while one goal runs, N goals wait and the N+1st is rejected (queue full)."""
    running = client.send(**long_goal())
    running.wait_feedback(1)
    queued = [client.send(prompt=f"Robot number {i} is", max_tokens=2) for i in range(QUEUE_DEPTH + 1)]
    assert [run.accepted for run in queued] == [True] * QUEUE_DEPTH + [False]
    client.wait_log(f"queue full: {QUEUE_DEPTH} goals waiting")
    # A waiting goal's cancel does not wait for the running goal.
    client.cancel(queued[0])
    assert queued[0].wait_result().finish_reason == "cancelled"
    assert queued[0].status == GoalStatus.STATUS_CANCELED and running.status is None
    client.cancel(running)
    assert running.wait_result().finish_reason == "cancelled"
    assert collect(queued[1:QUEUE_DEPTH]) == [(True, "length")] * (QUEUE_DEPTH - 1)


@pytest.mark.timeout(120)
def test_spec_mode_switch_during_stream(client: Client) -> None:
    """active: spec.mode set through ~/set_parameters while a goal streams shows in the following
    feedback and the result; invalid values are refused with a reason."""
    run = client.send(**long_goal(64))
    assert run.wait_feedback(1).spec_mode == "lookup"
    [result] = client.set_parameters(spec__mode="off")
    assert result.successful, result.reason
    switched_at = len(run.feedback)
    final = run.wait_result()
    assert final.spec_mode == "off" and final.stats.spec_mode == "off"
    # Feedback of the step in flight during the switch may still say lookup; then only off.
    modes = [f.spec_mode for f in run.feedback[switched_at:]]
    assert "off" in modes and set(modes[modes.index("off"):]) == {"off"}, modes

    refused = {"draft": "needs a draft model", "warp": "expected one of"}
    for mode, reason in refused.items():
        [result] = client.set_parameters(spec__mode=mode)
        assert not result.successful and reason in result.reason
    [result] = client.set_parameters(target__n_ctx=1024)
    assert not result.successful and "only change while unconfigured" in result.reason
    assert all(r.successful for r in client.set_parameters(spec__mode="lookup", spec__draft_max=K))


@pytest.mark.timeout(120)
def test_feedback_rate_limit_keeps_all_text(client: Client) -> None:
    """active: with feedback.min_period long, a goal gets its first and last feedback only, and the
    text between them is carried by the last one."""
    assert client.set_parameters(feedback__min_period=60.0)[0].successful
    try:
        run = client.send(prompt=PROMPT, max_tokens=12, seed=2)
        result = run.wait_result()
    finally:
        assert client.set_parameters(feedback__min_period=0.0)[0].successful
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    assert len(run.feedback) <= 2 and run.feedback[-1].completion_tokens == 12


@pytest.mark.timeout(120)
def test_diagnostics_carry_the_named_status(client: Client) -> None:
    """active, after requests: the status has tau and the other keys; the models status too."""
    status = client.wait_status(SPEC_STATUS, lambda s: s.level != DiagnosticStatus.STALE)
    values = key_values(status)
    for key in ("mode", "tau (mean acceptance length)", "acceptance rate", "K (draft_max)", "tokens/s",
                "TTFT p50 ms", "latency p50 s", "latency p95 s", "queue depth", "requests ok",
                "requests failed", "requests cancelled", "requests rejected", "last rejection",
                "RSS MiB"):
        assert key in values, key
    assert status.level in (DiagnosticStatus.OK, DiagnosticStatus.WARN)
    assert status.hardware_id and values["mode"] == "lookup" and values["K (draft_max)"] == str(K)
    assert int(values["requests ok"]) >= 1 and int(values["requests rejected"]) >= 13
    assert float(values["tokens/s"]) > 0 and float(values["RSS MiB"]) > 0
    assert float(values["tau (mean acceptance length)"]) >= 1.0
    assert 0.0 <= float(values["acceptance rate"]) <= 1.0


@pytest.mark.timeout(120)
def test_engine_error_aborts_the_goal_and_the_node_keeps_serving(client: Client,
                                                                  node: GemmaSpecNode,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """active: an engine failure (injected: the real engine cannot be made to fail a rollback on
    demand) aborts that goal with the error text and turns diagnostics ERROR; the next goal works."""
    engine = node._engine

    def failing_generate(request, cancel=None):  # noqa: ANN001  the engine's signature
        raise KVCacheError("llama_memory_seq_rm refused to remove cells (test)")
        yield  # pragma: no cover  (a generator, like the real one)

    monkeypatch.setattr(engine, "generate", failing_generate)
    run = client.send(prompt="Hello", max_tokens=4)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_ABORTED
    assert result.finish_reason == "error" and "refused to remove cells" in result.error
    client.wait_status(SPEC_STATUS, lambda s: s.level == DiagnosticStatus.ERROR)

    monkeypatch.undo()
    run = client.send(prompt="Hello", max_tokens=4)
    assert run.wait_result().finish_reason == "length" and run.status == GoalStatus.STATUS_SUCCEEDED
    client.wait_status(SPEC_STATUS, lambda s: s.level in (DiagnosticStatus.OK, DiagnosticStatus.WARN))


@pytest.mark.timeout(120)
def test_deactivate_cancels_the_running_goal_and_goes_stale(client: Client) -> None:
    """active -> inactive while a goal runs: it ends cancelled (ABORTED: not its client's cancel);
    diagnostics go STALE; goals are rejected; activate serves again."""
    run = client.send(**long_goal())
    run.wait_feedback(1)
    waiting = client.send(prompt="Hello", max_tokens=2)
    assert client.transition("deactivate") is True
    for goal in (run, waiting):
        result = goal.wait_result()
        assert goal.status == GoalStatus.STATUS_ABORTED
        assert result.finish_reason == "cancelled" and "deactivated" in result.error
    assert waiting.result.completion_tokens == 0
    assert client.state() == "inactive"
    client.wait_status(SPEC_STATUS, lambda s: s.level == DiagnosticStatus.STALE)
    assert not client.send(prompt="Hello", max_tokens=2).accepted
    assert client.transition("activate") is True
    assert client.send(prompt="Hello", max_tokens=2).wait_result().finish_reason == "length"


@pytest.mark.timeout(120)
def test_lifecycle_down_to_finalized(client: Client, node: GemmaSpecNode) -> None:
    """active -> inactive -> unconfigured -> finalized through ~/change_state and ~/get_state;
    cleanup saves the dynamic n-gram cache."""
    assert client.state() == "active"
    assert client.transition("deactivate") is True and client.state() == "inactive"
    assert client.transition("cleanup") is True and client.state() == "unconfigured"
    assert Path(node.get_parameter("lookup.dynamic_path").value).is_file()
    assert client.transition("shutdown") is True and client.state() == "finalized"
