"""The multi-request traces (gemma_spec_dev.bench.trace, .trace_replay): their requests, the replay
of drafters over scripted outputs, the figures, and one short timed trace on the embedded model with
llama.cpp's tools."""
from __future__ import annotations

import doctest
import json
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest

from gemma_spec_dev.bench import trace, trace_prompts, trace_replay
from gemma_spec_dev.bench.trace_requests import trace_requests
from gemma_spec_ros.engine.config import SuffixConfig
from gemma_spec_ros.engine.modes import MODES

from support.servers import LLAMA_SERVER


def test_module_doctests() -> None:
    for module in (trace_replay, trace):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_the_planner_trace_is_the_planner_suite_with_new_instructions(repo_root: Path) -> None:
    free, constrained = trace_requests("planner"), trace_requests("planner", constrained=True)
    assert len(free) == len(constrained) == len(set(trace_prompts.PLANNER_INSTRUCTIONS)) >= 30
    system = free[0].prompt.split("\n\nInstruction: ")[0]
    assert "You are the task planner" in system and all(r.prompt.startswith(system) for r in free)
    assert all(r.prompt.endswith("\nPlan:") and not r.json_schema for r in free)
    schema = (repo_root / "gemma_spec_ros" / "config" / "schemas" / "robot_plan.schema.json").read_text()
    assert all(r.json_schema == schema for r in constrained)


def test_every_agent_turn_shows_the_file_as_the_turns_before_left_it() -> None:
    turns = trace_requests("agent")
    assert len(turns) == len(trace_prompts.AGENT_EDITS) > 5
    text = trace_prompts.AGENT_FILE
    for turn, (ask, old, new) in zip(turns, trace_prompts.AGENT_EDITS):
        assert f"```python\n{text}```\n\n{ask} " in turn.prompt
        assert old in text, f"the edit of {turn.id} finds nothing to replace: {old!r}"
        text = text.replace(old, new)
    with pytest.raises(ValueError, match="no schema"):
        trace_requests("agent", constrained=True)


def test_the_suites_trace_is_every_single_prompt_suite_prompt_once_in_the_benchs_order(repo_root: Path) -> None:
    from gemma_spec_dev.bench.config import load_suites
    suites = load_suites(repo_root / "gemma_spec_ros" / "prompts")
    requests = trace_requests("suites")
    assert [r.id for r in requests] == [f"{s.name}/{p.id}" for s in suites for p in s.prompts]
    assert all(not r.json_schema for r in requests) and len({r.id for r in requests}) == len(requests)
    with pytest.raises(ValueError, match="no schema"):
        trace_requests("suites", constrained=True)


def scripted_trace(requests: int = 12) -> Dict[str, Any]:
    """Outputs of a planner that repeats the pattern of its earlier answers with a new object each
    time (token ids only: no model)."""
    texts = []
    for number in range(requests):
        prompt = [2, 500 + number, 7, 8]
        plan = [10, 11, 12, 13, 300 + number, 14, 15, 16, 17, 18, 300 + number, 19, 20, 21, 22, 23, 24, 25]
        texts.append({"id": f"plan-{number:02d}", "prompt": prompt, "out": plan * 2})
    return {"texts": texts}


def test_the_replay_carries_the_history_across_requests() -> None:
    saved = scripted_trace()
    strategies = trace_replay.parse_strategies("lookup,suffix,suffix+lookup,suffix[none]/K4",
                                               {"none": SuffixConfig(history_max_tokens=0)}, 12)
    figures = trace_replay.replay_all(saved, strategies, trace_replay.pass_costs(trace_replay.PASS_TABLES[trace_replay.DEFAULT_PASS_TABLE]),
                                      lambda: None)
    median = {name: trace_replay.median_after_warm([f["speedup"] for f in rows]) for name, rows in figures.items()}
    # a later answer follows the earlier ones for 4 tokens before its object: only a history drafts them
    assert median["suffix"] > median["suffix[none]/K4"] > 1.0 and median["lookup"] > 1.0
    first = [f["tokens_per_pass"] for f in figures["suffix"]]
    assert first[-1] > first[0]  # the first request has no history yet
    report = trace_replay.report(saved, figures)
    assert "median>5" in report and "vs lookup" in report and "plan-11" in report


def test_the_replay_charges_the_passes_a_timed_trace_measured() -> None:
    """bench.trace keeps each engine runner's passes by rows (pass_profile); the replay's pass
    costs can be those: per rows the median over the runners that timed it often enough."""
    lookup = trace.pass_profile({1: [0.016, 0.018, 0.017, 0.016, 0.015], 4: [0.034] * 5, 9: [0.07]})
    suffix = trace.pass_profile({1: [0.015] * 5, 4: [0.036] * 6})
    assert lookup[1] == {"passes": 5, "median_ms": 16.0} and lookup[9]["passes"] == 1
    timed = {"runners": {"lookup": {"pass_ms": lookup}, "suffix": {"pass_ms": suffix},
                         "llama-lookup/K3": {"command": []}}}
    assert trace_replay.traced_pass_ms(timed) == "1:15.50,4:35.00"  # 9 rows: timed once only
    assert trace_replay.replay_pass_ms("1:15.5,4:35", {})[3] == pytest.approx(28.5)
    assert trace_replay.replay_pass_ms("trace-fit", {})[2] == pytest.approx(15.9 + 7.41, abs=0.01)
    with pytest.raises(ValueError, match="no one-row passes"):
        trace_replay.traced_pass_ms({"runners": {"off": {"pass_ms": {}}}})


def test_strategies_and_variants_parse() -> None:
    name, variant = trace_replay.parse_suffix_variant("f2:match_factor=2,keep_prompts=true,max_occurrences=8")
    assert name == "f2" and variant == SuffixConfig(match_factor=2.0, keep_prompts=True, max_occurrences=8)
    strategy = trace_replay.parse_strategies("suffix[f2]+lookup/K16", {"f2": variant}, 12)[0]
    assert strategy.chain == ("suffix", "lookup") and strategy.draft_max == 16 and strategy.suffix == variant
    with pytest.raises(ValueError, match="not a mode of the table"):
        trace_replay.parse_strategies("suffix+draft", {}, 12)
    with pytest.raises(ValueError, match="not a mode of the table"):
        trace_replay.parse_strategies("draft+lookup", {}, 12)  # it needs a draft model
    assert trace_replay.parse_strategies("auto", {}, 12)[0].chain == MODES["auto"].chain  # with what it has
    with pytest.raises(ValueError, match="no suffix variant"):
        trace_replay.parse_strategies("suffix[x]", {}, 12)


def record(index: int, runner: str, rate: float) -> Dict[str, Any]:
    return {"index": index, "runner": runner, "tokens_per_s": rate, "tau": 2.0, "prompt_id": f"r{index}"}


def test_figures_are_same_request_ratios_after_the_first_five() -> None:
    records: List[Dict[str, Any]] = []
    for index in range(8):
        records += [record(index, "off", 10.0), record(index, "lookup", 20.0),
                    record(index, "suffix", 30.0 if index >= 5 else 5.0),
                    record(index, "llama-server/ngram-cache", 25.0), record(index, "llama-server/none", 11.0)]
    records.append(record(7, "llama-lookup/K3", math.nan))
    names = ["off", "lookup", "suffix", "llama-server/ngram-cache", "llama-server/none", "llama-lookup/K3"]
    summary = trace.summarize(records, names)
    assert summary["suffix"]["vs_off"] == 3.0 and summary["suffix"]["vs_lookup"] == 1.5  # the first five left out
    assert math.isnan(summary["llama-lookup/K3"]["vs_off"])
    assert trace.best_native(summary) == "llama-server/ngram-cache"  # plain llama-server is no setting
    text = trace.markdown({"trace": "planner", "constrained": False, "requests": 8, "max_tokens": 16,
                           "model": "m.gguf", "summary": summary, "records": records,
                           "best_native": "llama-server/ngram-cache"})
    assert "| suffix | 30.0 | 3.00x | 1.50x | 1.20x |" in text


@pytest.mark.timeout(1800)
def test_a_short_trace_runs_every_kind_of_runner(tmp_path: Path) -> None:
    if not (LLAMA_SERVER.is_file() and (LLAMA_SERVER.parent / "llama-lookup").is_file()):
        pytest.skip(f"llama.cpp's tools are not built in {LLAMA_SERVER.parent}: scripts/build_native_tools.sh")
    out = tmp_path / "out"
    runners = "off,suffix+lookup,llama-lookup/K3,llama-server/ngram-cache"
    assert trace.main(["--trace", "agent", "--requests", "2", "--max-tokens", "8", "--runners", runners,
                       "--native-bin", str(LLAMA_SERVER.parent), "--out", str(out)]) == 0
    results = json.loads((out / "trace.json").read_text())
    assert [r["runner"] for r in results["records"]] == ["off", "suffix+lookup", "llama-lookup/K3",
                                                         "llama-server/ngram-cache", "suffix+lookup",
                                                         "llama-lookup/K3", "llama-server/ngram-cache", "off"]
    assert not any(r["error"] for r in results["records"]), results["records"]
    assert all(r["n_tokens"] >= 7 and r["text"] for r in results["records"])
    assert (out / "work" / "llama-lookup_K3-repeat0.lcd").stat().st_size > 0  # one cache for the trace
    assert "| suffix+lookup |" in (out / "trace.md").read_text()
