"""The node with ``backend: remote`` and ``remote.fallback: local`` whose server is down: goals are
served by the local model, and /diagnostics says so (WARN, ``served by: local``)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest
import rclpy
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter

from gemma_spec_ros.node.node import MIN_EXECUTOR_THREADS, GemmaSpecNode
from remote_servers import free_port
from test_node_harness import Client, key_values

NODE = "gemma_spec_remote_fallback"
SPEC_STATUS = f"{NODE}: speculative decoding"


@pytest.fixture(scope="module")
def client(embedded_model_path: Path) -> Iterator[Client]:
    rclpy.init()
    overrides = {"backend": "remote", "remote.url": f"http://127.0.0.1:{free_port()}",
                 "remote.fallback": "local", "remote.connect_timeout": 0.5,
                 "remote.probe_period": 0.2, "target.model_path": str(embedded_model_path),
                 "target.n_ctx": 256, "target.n_threads": 1, "diagnostics.period": 0.2}
    gemma = GemmaSpecNode(NODE, parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
    executor = MultiThreadedExecutor(num_threads=MIN_EXECUTOR_THREADS + 2)
    executor.add_node(gemma)
    threading.Thread(target=executor.spin, daemon=True).start()
    ros = Client(f"/{NODE}", name="gemma_spec_remote_fallback_client")
    yield ros
    ros.close()
    gemma.release("test teardown")
    executor.shutdown(timeout_sec=5.0)
    gemma.destroy_node()
    rclpy.try_shutdown()


@pytest.mark.timeout(180)
def test_unreachable_server_falls_back_to_the_local_model(client: Client) -> None:
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
