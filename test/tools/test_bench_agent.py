"""The agent-loop bench (gemma_spec_dev.bench.agent_loop) on the embedded model with the agent
suite's template: two turns of one task, a mode with and without prompt reuse and a speculative one,
the files it writes and the figures it reads from them. (The full run, with llama-server's settings,
is docs/bench/cpu_agent_loop; its figures are in docs/benchmarks.md.)"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gemma_spec_dev.bench import agent_loop


def test_left_out_calls_are_read_from_the_reply_error() -> None:
    assert agent_loop._left_out("") == 0
    assert agent_loop._left_out("tool_choice required but the reply calls no tool") == 0
    assert agent_loop._left_out("the reply calls 'fly', which is not a tool offered this turn; "
                                "the arguments of 'say' do not follow its schema: x") == 2


def test_ratios_pair_the_same_task_and_turn() -> None:
    records = [{"runner": r, "task": t, "turn": n, "tokens_per_s": v}
               for r, t, n, v in (("a", 0, 0, 2.0), ("off", 0, 0, 1.0), ("a", 0, 1, 3.0), ("off", 0, 1, 2.0),
                                  ("a", 1, 0, 5.0), ("off", 1, 0, math.nan))]
    assert agent_loop.ratios(records, "a", "off", "tokens_per_s") == [2.0, 1.5]
    assert agent_loop.ratios(records, "a", "off", "tokens_per_s", follow_only=True) == [1.5]


@pytest.mark.timeout(900)
def test_the_bench_plays_the_turns_and_reports_them(tmp_path: Path, embedded_model_path: Path) -> None:
    out = tmp_path / "out"
    assert agent_loop.main(["--model", str(embedded_model_path), "--tasks", "1", "--turns", "2",
                            "--modes", "off,suffix", "--no-reuse-modes", "off", "--auto-modes", "", "--server-settings", "",
                            "--max-tokens", "48", "--n-ctx", "2048", "--threads", "2", "--out", str(out)]) == 0
    results = json.loads((out / "agent_loop.json").read_text())
    summary = results["summary"]
    assert set(summary) == {"off", "suffix", "off/no-reuse"}
    for name, row in summary.items():
        assert row["valid_share"] == 1.0 and row["calls_left_out"] == 0, (name, results["records"])
        assert row["call_turns_with_calls"] == row["call_turns"] == 2
    follow = {r["runner"]: r for r in results["records"] if r["turn"] == 1}
    assert follow["off"]["reused_tokens"] > follow["off/no-reuse"]["reused_tokens"] == 0
    assert follow["suffix"]["reused_tokens"] >= results["records"][0]["prompt_tokens"]
    table = (out / "agent_loop.md").read_text()
    assert "| off | 100% | 2/2 | 2/2 |" in table and "follow-up TTFT vs no reuse" in table
