"""gemma-spec-soak's smoke profile: the real server subprocess (embedded model, one thread) driven by
the soak tool over loopback DDS, with the whole goal mix: valid goals, JSON-schema goals (every stop
result valid), chat turns with tools (every call valid; malformed turns refused), hostile grammars and schemas (refused or served, never fatal), invalid goals and
parameters (bad default constraints among them) refused with a reason, cancels, lifecycle cycles.
The soak's own checks must pass: 0 lost goals, goal responses within 1 s and results within their
budget + 5 s (the soak's acceptance bounds, not a speed goal), cancels end CANCELED, streamed ==
result text, the same greedy output at the end, the fresh-engine check (the node's answers to
reference requests are a fresh engine's at the start, after each cycle and at the end), exit status 0 after SIGINT with goals running and
queued, a valid cache file. The remote phase's profile runs the same with a real llama-server
frozen (SIGSTOP) for 5 s."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest

from gemma_spec_dev.soak.records import GoalRecord
from gemma_spec_dev.soak.remote_phase import DEFAULT_LLAMA_SERVER
from gemma_spec_dev.soak.records import SoakRun
from gemma_spec_dev.soak.report import (chat_calls_check, fresh_check, percentiles, render_svg, schema_check,
                                        slope, timing_checks)
from gemma_spec_dev.soak.scenario import (BAD_DEFAULT_CONSTRAINTS, CHAT_TOOLS_JSON, SCHEMAS, cycle_plan,
                                          hostile_chat_goals, hostile_goals, malformed_chat_goals)
from gemma_spec_ros.client import GoalRun, NoAnswer

#: The hostile kinds the scenario sends (each must show in a run's report), and its hostile chat
#: turns (sent among the chat goals, by chance: may show).
HOSTILE_KINDS = {kind for kind, _ in hostile_goals({"max_grammar_bytes": 1024}, 8)}
HOSTILE_CHAT_KINDS = {kind for kind, _ in hostile_chat_goals(
    {"max_grammar_bytes": 1024, "max_prompt_tokens": 8, "max_prompt_bytes": 400})}


def test_helpers() -> None:
    assert percentiles([3.0, 1.0, 2.0])["p50"] == 2.0
    cycles = ["deactivate", "cleanup", "remote"]
    assert sorted(label for _, label in cycle_plan(random.Random(0), cycles, 40)) == sorted(cycles)
    # too few goals for every cycle: the remote phase stays (the clients keep going until it ran)
    assert cycle_plan(random.Random(0), cycles, 2) == [(1, "remote")]
    assert slope([0, 10], [100, 101]) == pytest.approx(0.1)
    assert "<polyline" in render_svg([{"t": 0.0, "rss_mib": 1.0}, {"t": 1.0, "rss_mib": 2.0}])


def test_the_new_checks_fail_what_they_must() -> None:
    """The report's checks on hand-made records: a stop text that is not valid for its schema, a
    slow goal response, a result past its budget + 5 s each fail; the hostile goals fit the size
    limit and the bad default constraints are among the invalid parameter draws."""
    schema = json.dumps(SCHEMAS[1])  # an integer 0..99
    def stopped(text: str) -> GoalRecord:
        return GoalRecord(0, "json schema", False, json_schema=schema, accepted=True, finish_reason="stop",
                          text=text, sent_at=1.0, accepted_at=1.1, result_at=2.0)
    assert schema_check([stopped("42")])["pass"]
    assert not schema_check([stopped("142")])["pass"] and not schema_check([stopped("4 2")])["pass"]
    slow = GoalRecord(1, "greedy", False, accepted=False, sent_at=1.0, accepted_at=2.5)
    late = GoalRecord(2, "greedy", False, accepted=True, sent_at=1.0, accepted_at=1.1, result_at=20.0,
                      time_budget=10.0, finish_reason="timeout")
    checks = timing_checks([slow, late, stopped("7")])
    assert [check["pass"] for check in checks.values()] == [False, False]
    assert [check["pass"] for check in timing_checks([stopped("7")]).values()] == [True, True]
    slow.response_lost = True  # the client's delay (ros2/rclpy#1123), not the server's answer
    assert next(iter(timing_checks([slow]).values()))["pass"]
    for _, fields in hostile_goals({"max_grammar_bytes": 65536}, 8):
        assert len((fields.get("grammar") or fields.get("json_schema")).encode()) <= 65536
    assert ("generation.grammar", "root ::= nope") in BAD_DEFAULT_CONSTRAINTS


def test_the_chat_and_fresh_checks_fail_what_they_must() -> None:
    """A call of a tool not offered, arguments against the schema, a call of another tool than the
    named one, a tool_calls turn without calls: each fails the chat check; a reference answer that
    differs beyond a near-tie fails the fresh-engine check, one at a near-tie passes."""
    def turn(calls: List[Tuple[str, str]], choice: str = "required", reason: str = "tool_calls") -> GoalRecord:
        return GoalRecord(0, "chat: required", False, chat=True, tools=CHAT_TOOLS_JSON, tool_choice=choice,
                          accepted=True, result_at=2.0, finish_reason=reason, tool_calls=calls)
    assert chat_calls_check([turn([("move_to", '{"place": "lab"}')])])["pass"]
    for bad in (turn([("fly", "{}")]), turn([("move_to", '{"place": "moon"}')]),
                turn([("say", '{"text": "hi"}')], choice="move_to"), turn([])):
        assert not chat_calls_check([bad])["pass"]

    def run(*outcomes: str) -> SoakRun:
        check = {"when": "end", "outcomes": [("prompt 0", o) for o in outcomes],
                 "pass": all(o == "same" or o.startswith("near-tie") for o in outcomes)}
        return SoakRun([], "", "", 0, 0.0, [], [], [], "", fresh_checks=[check])
    assert fresh_check(run("same", "near-tie at token 3 (gap 0.010)"))["pass"]
    assert not fresh_check(run("same", "differs at token 0 (gap 4.2): ..."))["pass"]
    assert not fresh_check(SoakRun([], "", "", 0, 0.0, [], [], [], ""))["pass"]  # never ran
    kinds = [kind for kind, _ in malformed_chat_goals({"max_prompt_tokens": 64, "max_prompt_bytes": 1024})]
    assert len(kinds) == len(set(kinds)) >= 10


class _Handle:
    """A goal handle whose result requests are answered from the ``answers`` list, in order (None:
    never answered). A fake: the client-side race it stands for (rclpy dropping a result response
    that arrives before get_result_async stored its future) cannot be produced on demand."""

    def __init__(self, answers):
        self.answers, self.requests = list(answers), 0

    def get_result_async(self):
        self.requests += 1
        answer = self.answers.pop(0) if self.answers else None
        return SimpleNamespace(add_done_callback=lambda done: done(SimpleNamespace(result=lambda: answer))
                               if answer is not None else None)


@pytest.mark.timeout(300)
def test_the_fresh_judge_finds_where_a_longer_answer_parted(embedded_model_path: Path, tmp_path: Path) -> None:
    """The judge of soak/fresh.py on the embedded model. An answer that holds the whole fresh text
    and goes on parted from it somewhere: where the fresh engine ended its text (the code
    reference: its first token is an end of generation, 0.02 above ``def``, a near-tie), or, for a
    fresh text of max_tokens tokens, where the node took a longer token: text no token the fresh
    engine ranks near its own choice continues differs. Before, both were "differs after the fresh
    text" whatever the logits said."""
    from gemma_spec_dev.soak.fresh import NEAR_TIE, FreshCheck
    from support.chat import embedded_template_file

    fresh = FreshCheck({"target.model_path": str(embedded_model_path), "target.n_ctx": 512, "target.n_batch": 512,
                        "target.n_threads": 1, "target.flash_attn": True,
                        "chat.template_path": str(embedded_template_file(tmp_path)), "generation.prompt_cache": True})
    try:
        ended = [r for r in fresh.references if not r.chat and len(r.tokens) < r.fields["max_tokens"]]
        full = [r for r in fresh.references if not r.chat and len(r.tokens) == r.fields["max_tokens"]]
        assert ended and full, [(r.kind, len(r.tokens)) for r in fresh.references]
        for reference in fresh.references:
            assert fresh.judge(reference, reference.text) == "same"
        code = next(r for r in ended if r.fields["prompt"].startswith("def "))
        verdict = fresh.judge(code, code.text + "def div(a, b):\n    return a // b\n")
        assert verdict.startswith(f"near-tie at token {len(code.tokens)} ("), verdict
        assert float(verdict.split("gap ")[1].rstrip(")")) <= NEAR_TIE
        verdict = fresh.judge(full[0], full[0].text + "\u00b6\u00b6 zq")
        assert verdict.startswith("differs at token "), verdict
    finally:
        fresh.close()


def test_a_dropped_result_response_is_asked_for_again_and_not_counted_lost() -> None:
    """Soak found it (1 of 3,796 goals, 30 minutes): the node answered, the client dropped the
    response ("Ignoring unexpected result response") and the goal counted as lost. The client now
    asks again (GoalRun.wait_result's resend_after, which the soak uses); a goal is lost only if no
    request is ever answered."""
    answer = SimpleNamespace(status=4, result="result")
    for answers, found in (([None, answer], True), ([None, None], False)):
        handle = _Handle(answers[1:])  # answers[0]: the first request, sent before the wait
        run = GoalRun(accepted=True, handle=handle)
        if found:
            assert run.wait_result(timeout=1.0, resend_after=0.05) == "result" and run.result_resent
        else:
            with pytest.raises(NoAnswer):
                run.wait_result(timeout=1.0, resend_after=0.05)
        assert handle.requests >= 1


def run_soak(repo_root: Path, model: Path, out: Path, options: List[str],
             overrides: Dict[str, Any]) -> Tuple[subprocess.CompletedProcess, Dict[str, Any]]:
    """gemma-spec-soak on the embedded profile with ``options`` and server ``overrides``; the
    process and its soak.json. Every check must pass and the exit status be 0."""
    overrides = {"target.model_path": str(model), "target.n_threads": 1, "target.n_ctx": 1024,
                 "limits.max_prompt_tokens": 768, "limits.max_tokens": 64, "generation.max_tokens": 12,
                 "diagnostics.period": 0.5, **overrides}
    cmd = [sys.executable, "-m", "gemma_spec_dev.soak",
           "--params-file", str(repo_root / "gemma_spec_ros" / "config" / "embedded.yaml"),
           "--node-name", f"gemma_spec_soak_{os.getpid()}", "--sample-period", "2",
           "--max-tokens", "12", "--out", str(out), "--no-progress", *options]
    for name, value in overrides.items():
        cmd += ["--set", f"{name}:={value}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo_root / "gemma_spec_ros"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    report = json.loads((out / "soak.json").read_text())
    failed = {name: check for name, check in report["checks"].items() if not check["pass"]}
    assert not failed, (failed, proc.stderr[-3000:])
    assert proc.returncode == 0
    return proc, report


@pytest.mark.timeout(420)
def test_smoke_profile(repo_root: Path, embedded_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cache = tmp_path / "dynamic.bin"
    _, report = run_soak(
        repo_root, embedded_model_path, out,
        ["--goals", "48", "--clients", "2", "--cycles", "1", "--cleanup-cycles", "1",
         "--hostile-share", "0.25", "--schema-share", "0.35", "--goal-budget", "20",
         "--flip-period", "0.5", "1.5", "--warmup", "5", "--goal-timeout", "120", "--final-goals", "3"],
        {"lookup.dynamic_path": str(cache), "lookup.cache_dir": str(tmp_path), "lookup.save_period": 2.0})
    metrics, checks = report["metrics"], report["checks"]
    assert metrics["accepted"] > 0 and metrics["rejected"] > 0
    sent = {r["kind"] for r in metrics["goal_records"] if r["hostile"]}
    assert HOSTILE_KINDS <= sent <= HOSTILE_KINDS | HOSTILE_CHAT_KINDS, sent
    assert metrics["schema_goals_stopped"] > 0  # and each of them valid: the check above
    assert checks["bad default constraints refused"]["pass"]
    assert metrics["chat_goals_accepted"] > 0 and "chat turns: calls valid" in checks
    assert any(r["chat"] and r["invalid"] for r in metrics["goal_records"])  # and each refused: the check
    whens = [check["when"] for check in metrics["fresh_checks"]]
    assert whens[0] == "start" and whens[-1] == "end" and "after cleanup" in whens
    assert (out / "soak.md").is_file() and (out / "rss.svg").is_file()


@pytest.mark.timeout(240)
@pytest.mark.skipif(not DEFAULT_LLAMA_SERVER.is_file(),
                    reason=f"llama-server not built at {DEFAULT_LLAMA_SERVER} (scripts/build_native_tools.sh)")
def test_remote_phase_with_a_frozen_llama_server(repo_root: Path, embedded_model_path: Path,
                                                  tmp_path: Path) -> None:
    """The remote phase on a real llama-server, frozen for 5 s: the soak's own checks pass (every
    goal alive during the freeze ended within its budget + margin, goals succeed after the
    resume, 0 lost, the greedy output back on the local model equal to the start's)."""
    _, report = run_soak(
        repo_root, embedded_model_path, tmp_path / "soak",
        ["--goals", "8", "--clients", "2", "--cycles", "0", "--cleanup-cycles", "0",
         "--remote-phase", "16", "--freeze", "5", "--remote-budget", "4",
         "--flip-period", "0.5", "1.0", "--warmup", "2", "--goal-timeout", "60", "--final-goals", "1"],
        {"lookup.dynamic_path": str(tmp_path / "dynamic.bin"), "lookup.cache_dir": str(tmp_path)})
    assert "remote phase: goals during the freeze ended" in report["checks"]
    records = report["metrics"]["goal_records"]
    during = [r for r in records if r["remote"] and r["accepted"]]
    assert during and {r["finish_reason"] for r in during} & {"timeout", "error", "cancelled"}
    assert report["metrics"]["remote_phase"]["url"].startswith("http://127.0.0.1:")
