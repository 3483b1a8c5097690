"""The several-clients bench (gemma_spec_dev.bench.clients): how goals are split among clients, the
same-run ratios of its table, and one short run on the embedded model with llama-server where built."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gemma_spec_dev.bench import clients
from gemma_spec_dev.bench.trace_requests import trace_requests

from support.servers import LLAMA_SERVER


def test_each_client_takes_every_nth_goal() -> None:
    requests = trace_requests("planner")
    goals = clients.split(requests, 3, 2)
    assert [[r.id for r in client] for client in goals] == [
        [requests[0].id, requests[3].id], [requests[1].id, requests[4].id], [requests[2].id, requests[5].id]]


def test_the_table_pairs_runs_of_the_same_repeat() -> None:
    runs = [{"repeat": r, "clients": 3, "runner": name, "tokens_per_s": rate, "latency_median_s": 1.0,
             "latency_p90_s": 2.0, "errors": 0}
            for r, rates in enumerate(((30.0, 20.0, 25.0, 10.0), (15.0, 10.0, 14.0, 4.0)))
            for name, rate in zip(("together/off", "one-at-a-time/off", "llama-server/none",
                                   "llama-server/ngram-mod/n4"), rates)]
    [row] = [row for row in clients.table(runs) if row["runner"] == "together/off"]
    assert row["vs_one_at_a_time"] == pytest.approx(1.5)  # 30/20 and 15/10
    assert row["best_server"] == "llama-server/none"
    assert row["vs_best_server"] == pytest.approx((30 / 25 + 15 / 14) / 2)


@pytest.mark.timeout(900)
def test_a_short_run_writes_its_figures(tmp_path: Path) -> None:
    servers = "none" if LLAMA_SERVER.is_file() else ""
    out = tmp_path / "clients"
    assert clients.main(["--clients", "2", "--modes", "off", "--servers", servers, "--goals-per-client", "1",
                         "--max-tokens", "8", "--repeats", "1", "--native-bin", str(LLAMA_SERVER.parent),
                         "--out", str(out)]) == 0
    results = json.loads((out / "clients.json").read_text())
    runners = {run["runner"] for run in results["runs"]}
    assert {"together/off", "one-at-a-time/off"} <= runners
    assert ("llama-server/none" in runners) == bool(servers)
    for run in results["runs"]:
        assert run["errors"] == 0 and run["goals"] == 2 and run["tokens"] == 16, run
    [together] = [row for row in results["table"] if row["runner"] == "together/off"]
    assert together["vs_one_at_a_time"] > 0 and not math.isnan(together["vs_one_at_a_time"])
    assert results["kv_bytes_per_token"] > 0
    assert "| 2 | together/off |" in (out / "clients.md").read_text()
    assert (out / "clients.png").stat().st_size > 0
