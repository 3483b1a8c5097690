"""``gemma-spec-bench --via-remote URL``: the same prompts streamed from a real llama_cpp.server on
loopback, interleaved with the local runners, with same-run ratios against local ``off``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemma_spec_dev import bench
from gemma_spec_dev.bench.remote import RUNNER_NAME, remote_runners
from support.servers import llama_cpp_server, missing_server_extra


def test_remote_runner_is_planned_only_with_a_url() -> None:
    assert remote_runners("", ["plain"]) == []
    [spec] = remote_runners("http://127.0.0.1:8080", ["plain"])
    assert (spec.name, spec.kind, spec.reference) == (RUNNER_NAME, "remote", "lcp-plain")
    assert remote_runners("http://127.0.0.1:8080", [])[0].reference == "off"


@pytest.mark.timeout(600)
def test_bench_smoke_via_remote(embedded_model_path: Path, tmp_path: Path) -> None:
    missing = missing_server_extra()
    if missing:
        pytest.fail(missing)
    server = llama_cpp_server(embedded_model_path, tmp_path, api_key="").start()
    config = tmp_path / "params.yaml"
    config.write_text("/**:\n  ros__parameters:\n    target:\n"
                      f"      model_path: {embedded_model_path}\n      n_threads: 1\n      n_ctx: 1024\n")
    out = tmp_path / "bench"
    try:
        status = bench.main(["--config", str(config), "--smoke", "--modes", "off", "--baselines", "plain",
                             "--via-remote", server.url, "--out", str(out), "--no-progress"])
    finally:
        server.stop()
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["via_remote"] == server.url
    runs = [r for r in results["runs"] if r["runner"] == RUNNER_NAME]
    assert runs and all(not r["error"] for r in runs), runs
    assert all(r["n_tokens"] == 16 and r["ttft_s"] > 0 and r["tokens_per_s"] > 0 for r in runs)
    assert all(r["speedup"] and r["speedup_vs_reference"] for r in runs)  # vs off, vs lcp-plain
    entry = results["summary"]["runners"][RUNNER_NAME]
    assert entry["kind"] == "remote" and entry["reference"] == "lcp-plain" and "vs_reference" in entry
    assert "`remote`" in (out / "results.md").read_text()
