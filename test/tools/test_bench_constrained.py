"""The constrained-output bench (gemma_spec_dev.bench.constrained) on the embedded model and
the real llama-server: a one-prompt suite with a small schema, every runner, the files it writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemma_spec_dev.bench import config as bench_config, constrained

from support.servers import LLAMA_SERVER

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["skill", "place"],
          "properties": {"skill": {"enum": ["navigate", "pick", "place"]},
                         "place": {"enum": ["kitchen_table", "sink", "dock"]}}}


def test_the_planner_suite_declares_the_plan_schema(repo_root: Path) -> None:
    suite = bench_config.load_suite(repo_root / "gemma_spec_ros" / "prompts" / "planner.yaml")
    assert suite.json_schema_path == (repo_root / "gemma_spec_ros" / "config" / "schemas" / "robot_plan.schema.json").resolve()
    assert constrained.validate('{"skill": "pick"}', SCHEMA).startswith("invalid")
    assert constrained.validate("{", SCHEMA).startswith("not JSON")
    assert constrained.validate('{"skill": "pick", "place": "sink"}', SCHEMA) == ""


@pytest.mark.timeout(600)
def test_constrained_bench_runs_every_runner_and_reports_validity(tmp_path: Path, embedded_model_path: Path) -> None:
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"no llama-server at {LLAMA_SERVER}: scripts/build_native_tools.sh builds it")
    (tmp_path / "action.schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "tiny.yaml").write_text(
        "name: tiny\njson_schema_file: action.schema.json\nprompts:\n"
        "  - id: next\n    text: 'The robot''s next action as JSON:'\n")
    out = tmp_path / "out"
    assert constrained.main(["--model", str(embedded_model_path), "--prompts-dir", str(tmp_path),
                             "--suite", "tiny", "--server-settings", "none", "--max-tokens", "48",
                             "--n-ctx", "256", "--threads", "2", "--out", str(out),
                             "--native-bin", str(LLAMA_SERVER.parent)]) == 0
    results = json.loads((out / "constrained.json").read_text())
    summary = results["summary"]
    assert set(summary) == {"off", "lookup", "auto", "off/free", "lookup/free", "llama-server/none"}
    off = [r for r in results["records"] if r["runner"] == "off"]
    assert off[0]["grammar_masks"] >= off[0]["tokens"], off  # every row (and the end-of-text one)
    for name, row in summary.items():
        if row["constrained"]:
            assert row["valid_share"] == 1.0, (name, results["records"])
    assert results["best_server"] == "llama-server/none"
    assert "| lookup | 100% |" in (out / "constrained.md").read_text()
    assert (out / "constrained.png").stat().st_size > 0
