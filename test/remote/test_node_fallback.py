"""The node with ``backend: remote`` and ``remote.fallback: local`` whose server is down: goals are
served by the local model, and /diagnostics says so (WARN, ``served by: local``)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus

from gemma_spec_ros.client import GenerateClient, key_values
from gemma_spec_ros.node import spec_status_name
from support.node import ServedNode
from support.servers import free_port

NODE = "gemma_spec_remote_fallback"
SPEC_STATUS = spec_status_name(NODE)


@pytest.fixture(scope="module")
def client(node_client: Callable[..., ServedNode], embedded_model_path: Path) -> GenerateClient:
    overrides = {"backend": "remote", "remote.url": f"http://127.0.0.1:{free_port()}",
                 "remote.fallback": "local", "remote.connect_timeout": 0.5,
                 "remote.probe_period": 0.2, "target.model_path": str(embedded_model_path),
                 "target.n_ctx": 256, "target.n_threads": 1, "diagnostics.period": 0.2}
    return node_client(NODE, overrides, activate=False).client


@pytest.mark.timeout(180)
def test_unreachable_server_falls_back_to_the_local_model(client: GenerateClient) -> None:
    assert client.transition("configure") and client.transition("activate")
    client.wait_log("unreachable at configure")
    run = client.send(prompt="The robot picked up the", max_tokens=4, temperature=0.0)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_SUCCEEDED and result.completion_tokens == 4
    assert result.spec_mode != "remote"  # the local engine's mode

    def served_locally(status: DiagnosticStatus) -> bool:
        return key_values(status).get("requests served local") == "1"

    status = client.wait_status(SPEC_STATUS, served_locally)
    values = key_values(status)
    assert values["served by"] == "local" and values["server reachable"] == "False"
    assert "cannot connect" in values["last fallback reason"]
    assert status.level == DiagnosticStatus.WARN and "serving from the local model" in status.message
