"""Gemma 4 MTP behind ``backend: remote``: llama.cpp's ``llama-server --spec-type draft-mtp -md <assistant>``
on the tiny agreeing gemma4 + gemma4-assistant pair, read by RemoteEngine: the server drafts with the
assistant and its tau reaches the request's stats (docs/deployment.md). Skipped where
scripts/build_native_tools.sh has not built llama-server.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import pytest

from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import SpecConfig
from support.servers import LLAMA_SERVER, Server, llama_server
from support.tiny_gemma4 import write_gemma4_pair

pytestmark = pytest.mark.skipif(
    not LLAMA_SERVER.is_file(),
    reason=f"llama-server not built at {LLAMA_SERVER} (scripts/build_native_tools.sh)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    target, assistant = write_gemma4_pair(tmp_path_factory.mktemp("gemma4"), agreeing=True)
    srv = llama_server(target, tmp_path_factory.mktemp("servers"),
                       ["--spec-type", "draft-mtp", "-md", str(assistant), "--spec-draft-n-max", "3",
                        "--spec-draft-p-min", "0"]).start()
    yield srv
    srv.stop()


@pytest.mark.timeout(120)
def test_llama_server_drafts_with_the_assistant_and_tau_reaches_the_stats(server: Server) -> None:
    engine = RemoteEngine(RemoteConfig(url=server.url, probe_period=0), SpecConfig(mode="off"))
    try:
        steps = list(engine.generate(GenerationRequest("the robot picks up the red cup. ", max_tokens=64)))
    finally:
        engine.close()
    stats = steps[-1].stats
    assert steps[-1].finish_reason == "length" and stats.num_generated_tokens == 64
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9, stats
    assert not math.isnan(stats.mean_acceptance_length) and stats.mean_acceptance_length > 3.0, stats
    log = Path(server.log_path).read_text(errors="replace")
    assert "loading draft model" in log and "assistant.gguf" in log, log[-2000:]
    assert "draft acceptance = 1.00000" in log, log[-2000:]  # the server's own count: all accepted
