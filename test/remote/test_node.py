"""The gemma_spec node with ``backend: remote`` on real rclpy, served by a real llama_cpp.server on
loopback: the same action, feedback, cancel and /diagnostics as local mode, the server's death and
restart seen from the node, spec.* changes refused.

One node and one server serve the whole module; the tests run in file order along their life.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Iterator

import pytest
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus

from gemma_spec_ros.client import GenerateClient, key_values, wait_until
from gemma_spec_ros.node import spec_status_name
from support.node import ServedNode
from support.servers import API_KEY, API_KEY_ENV, Server, running_llama_cpp_server

NODE = "gemma_spec_remote"
SPEC_STATUS = spec_status_name(NODE)
MODELS_STATUS = f"{NODE}: models"
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module")
def server(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from running_llama_cpp_server(embedded_model_path, tmp_path_factory.mktemp("servers"))


@pytest.fixture(scope="module")
def client(node_client: Callable[..., ServedNode], server: Server) -> Iterator[GenerateClient]:
    """A client of the node pointed at the server (the key in the variable it names), which it
    configured and activated (every test starts from active)."""
    os.environ[API_KEY_ENV] = API_KEY
    overrides = {
        "backend": "remote", "remote.url": server.url, "remote.api_key_env": API_KEY_ENV,
        "remote.connect_timeout": 1.0, "remote.probe_period": 0.2,
        "generation.max_tokens": 8, "limits.max_tokens": 600, "diagnostics.period": 0.2,
    }
    yield node_client(NODE, overrides).client
    os.environ.pop(API_KEY_ENV, None)


def requests_ok(client: GenerateClient) -> int:
    return int(key_values(client.wait_status(SPEC_STATUS))["requests ok"])


@pytest.mark.timeout(120)
def test_configures_against_the_server_and_reports_it(client: GenerateClient, server: Server) -> None:
    """Configured and active (the fixture): no model is loaded; the models status names the
    server, the spec status says it is reachable, with its RTT."""
    assert client.state() == "active"
    models = key_values(client.wait_status(MODELS_STATUS))
    assert models["target.backend"] == "remote" and models["target.url"] == server.url
    assert models["target.server"] == "llama-cpp-python server"
    status = client.wait_status(SPEC_STATUS, lambda s: key_values(s).get("server reachable") == "True")
    values = key_values(status)
    assert status.level == DiagnosticStatus.OK
    assert values["backend"] == "remote" and values["mode"] == "set by the server"
    assert 0 < float(values["server RTT ms"]) < 1000


@pytest.mark.timeout(120)
def test_goal_streams_feedback_and_reports_speed(client: GenerateClient) -> None:
    """active: feedback per chunk, the result with tokens/s and TTFT; tau unknown (not invented)."""
    ok = requests_ok(client)
    run = client.send(prompt=PROMPT, max_tokens=10, temperature=0.0, seed=1)
    assert run.accepted
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_SUCCEEDED and result.finish_reason == "length"
    assert result.completion_tokens == 10 and result.prompt_tokens > 10
    assert result.spec_mode == "remote" and result.text
    assert len(run.feedback) >= 3 and all(f.spec_mode == "remote" for f in run.feedback)
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    assert result.stats.tokens_per_second > 0 and result.stats.time_to_first_token_ms > 0
    assert math.isnan(result.stats.mean_acceptance_length)
    values = key_values(client.wait_status(SPEC_STATUS, lambda s: int(key_values(s)["requests ok"]) > ok))
    assert values["served by"] == "remote" and float(values["tokens/s"]) > 0
    assert values["tau (mean acceptance length)"] == "nan"


@pytest.mark.timeout(120)
def test_cancel_ends_the_goal_within_one_chunk(client: GenerateClient) -> None:
    run = client.send(prompt=PROMPT, max_tokens=500, temperature=0.0)
    assert run.accepted
    seen = run.wait_feedback(3)
    client.cancel(run)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_CANCELED and result.finish_reason == "cancelled"
    # one chunk is one token here; the chunk in flight when the cancel arrived may still land
    assert result.completion_tokens <= seen.completion_tokens + 3 < 500


@pytest.mark.timeout(60)
def test_spec_changes_and_goal_modes_are_refused(client: GenerateClient) -> None:
    [result] = client.set_parameters(spec__mode="off")
    assert not result.successful and "configured on the inference server" in result.reason
    assert not client.send(prompt="Hi", max_tokens=2, spec_mode="off").accepted
    client.wait_log("configured on the inference server")


@pytest.mark.timeout(300)
def test_server_death_fails_the_goal_then_the_node_serves_again(client: GenerateClient, server: Server) -> None:
    """The server is killed mid-goal: the goal aborts with finish_reason error and the reason;
    /diagnostics goes ERROR then shows it unreachable; once it is back the next goal succeeds."""
    run = client.send(prompt=PROMPT, max_tokens=400, temperature=0.0)
    assert run.accepted
    run.wait_feedback(2)
    server.kill()
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_ABORTED and result.finish_reason == "error"
    assert "stream" in result.error or "finish reason" in result.error
    assert result.text and result.completion_tokens >= 2  # what streamed before the death is kept
    down = client.wait_status(SPEC_STATUS, lambda s: key_values(s).get("server reachable") == "False")
    assert down.level == DiagnosticStatus.ERROR
    failed = client.send(prompt="Hi", max_tokens=2)
    assert failed.accepted and failed.wait_result().finish_reason == "error"
    assert "cannot connect" in failed.result.error
    server.start()
    client.wait_status(SPEC_STATUS, lambda s: key_values(s).get("server reachable") == "True")
    ok = requests_ok(client)
    again = client.send(prompt="The robot", max_tokens=3)
    assert again.wait_result().finish_reason == "length" and again.status == GoalStatus.STATUS_SUCCEEDED
    assert client.wait_status(SPEC_STATUS, lambda s: int(key_values(s)["requests ok"]) > ok).level == \
        DiagnosticStatus.OK
