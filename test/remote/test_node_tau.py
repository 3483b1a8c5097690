"""The node with ``backend: remote`` on a real llama.cpp ``llama-server`` running n-gram speculation:
the server's tau and acceptance reach the goal's result, ``~/spec_stats`` and ``/diagnostics`` under
the same keys as local mode. Skipped where scripts/build_native_tools.sh has not built llama-server.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterator

import pytest
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import GenerateClient, key_values
from gemma_spec_ros.node import spec_status_name
from support.node import ServedNode
from support.servers import LLAMA_SERVER, Server, llama_server

pytestmark = pytest.mark.skipif(
    not LLAMA_SERVER.is_file(),
    reason=f"llama-server not built at {LLAMA_SERVER} (scripts/build_native_tools.sh)")

NODE = "gemma_spec_remote_tau"
SPEC_STATUS = spec_status_name(NODE)
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n" * 2


@pytest.fixture(scope="module")
def server(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = llama_server(embedded_model_path, tmp_path_factory.mktemp("servers"),
                       ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                        "--spec-ngram-simple-size-m", "6"]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(node_client: Callable[..., ServedNode], server: Server) -> GenerateClient:
    overrides = {"backend": "remote", "remote.url": server.url, "remote.probe_period": 0.2,
                 "diagnostics.period": 0.2}
    return node_client(NODE, overrides, activate=False).client


@pytest.mark.timeout(180)
def test_server_tau_reaches_result_and_diagnostics(client: GenerateClient) -> None:
    assert client.transition("configure") and client.transition("activate")
    run = client.send(prompt=PROMPT, max_tokens=48, temperature=0.0)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_SUCCEEDED and result.spec_mode == "remote"
    stats = result.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert 1.0 <= stats.mean_acceptance_length <= 1 + stats.num_draft_tokens / stats.num_drafts
    assert result.prompt_tokens > 0 and result.completion_tokens == 48

    def with_tau(status) -> bool:
        values = key_values(status)
        return values.get("requests ok") == "1" and values["tau (mean acceptance length)"] != "nan"

    values = key_values(client.wait_status(SPEC_STATUS, with_tau))
    assert values["server"] == "llama.cpp server" and "timings" in values["tau source"]
    assert values["prompt tokens by"] == "llama.cpp server tokenizer"
    assert math.isclose(float(values["tau (mean acceptance length)"]), stats.mean_acceptance_length,
                        rel_tol=1e-3)
    assert math.isclose(float(values["acceptance rate"]), stats.acceptance_rate, rel_tol=1e-3)
