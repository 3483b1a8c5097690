"""The soak's verdict and figures: the PASS/FAIL checks, the metrics (latency percentiles, resource
slopes), and soak.md / rss.svg, all from the :class:`~.records.SoakRun` the driver collected."""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict
from typing import Any, Dict, List, Sequence

import jsonschema

from gemma_spec_ros.engine.drafters import learned_cache
from gemma_spec_ros.node.diagnostics import percentile

from .records import GoalRecord, Report, SoakRun
from .scenario import BAD_DEFAULT_CONSTRAINTS

#: The longest a goal response may take (from the request to the accept/reject answer).
RESPONSE_BOUND = 1.0
#: Seconds a result may come after its goal's time budget ran out (the budget counts from
#: acceptance; this covers the last step, the result's delivery and the client's side).
RESULT_MARGIN = 5.0


def percentiles(values: Sequence[float]) -> Dict[str, float]:
    """p50/p95/p99 (nearest rank, as the node's own diagnostics) of ``values`` that are not NaN;
    NaN when there are none.

    >>> percentiles([1, 2, 3, 4])["p50"]
    2
    """
    data = [v for v in values if not math.isnan(v)]
    return {"p50": percentile(data, 50), "p95": percentile(data, 95), "p99": percentile(data, 99),
            "n": len(data)}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs; NaN with fewer than 2 distinct xs.

    >>> slope([0, 1, 2], [1, 3, 5])
    2.0
    """
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def build_report(run: SoakRun, args: argparse.Namespace) -> Report:
    """Every check (PASS/FAIL with a detail) and metric of ``run``, soaked with ``args``."""
    records = run.records
    accepted = [r for r in records if r.accepted]
    lost = [r.index for r in records if r.accepted and not r.result_at]
    unanswered = [r.index for r in records if r.accepted is None]
    invalid_accepted = [r.kind for r in records if r.invalid and r.accepted]
    bad_cancels = [(r.index, r.cancel_point, r.status) for r in accepted
                   if r.cancel_accepted and r.status not in (4, 5)]  # SUCCEEDED, CANCELED
    mismatched = [(r.index, r.kind, r.streamed[:40], r.text[:40]) for r in accepted
                  if r.result_at and not r.streamed_matches()]
    params_bad = [p for p in run.param_results
                  if (p["valid"] and not p["ok"]) or (not p["valid"] and (p["ok"] or not p["reason"]))]
    rejections_logged = run.serve_log.count("goal rejected:")
    rejected = sum(1 for r in records if r.accepted is False)
    report = Report(config={k: v for k, v in vars(args).items()})
    checks = report.checks
    checks["0 lost"] = {"pass": not lost, "detail": f"{len(accepted)} accepted, lost: {lost[:20]}"}
    checks.update(timing_checks(records))
    checks["invalid goals refused"] = {
        "pass": not invalid_accepted,
        "detail": f"{sum(r.invalid for r in records)} invalid sent; accepted: {invalid_accepted[:10]}"}
    checks["hostile goals refused or served"] = hostile_check(records)
    checks["schema goals: stop results valid"] = schema_check(records)
    checks["chat turns: calls valid"] = chat_calls_check(records)
    malformed = [r for r in records if r.chat and r.invalid]
    served = [(r.index, r.kind, r.finish_reason) for r in malformed if r.accepted and not r.error]
    checks["malformed chat turns refused or ended with an error"] = {
        "pass": not served and not any(r.accepted is None for r in malformed),
        "detail": f"{len(malformed)} sent, {sum(1 for r in malformed if r.accepted is False)} refused; "
                  f"served without an error: {served[:10]}"}
    if args.fresh_check:
        checks["fresh-engine check"] = fresh_check(run)
    before_final = sum(1 for r in records if r.accepted is False and r.kind != "final")
    checks["rejections counted and logged"] = {
        # the node logs a burst of rejections, then a few per minute (a client refused in a loop
        # must not fill the disk); /diagnostics counts every one
        "pass": run.node_rejected >= before_final and (rejections_logged >= 1 or not rejected),
        "detail": f"{rejected} rejected; /diagnostics counted {run.node_rejected} before the final "
                  f"goals; {rejections_logged} 'goal rejected: <reason>' log lines"}
    checks["parameters"] = {"pass": not params_bad,
                            "detail": f"{len(run.param_results)} sets; wrong: {params_bad[:5]}"}
    bad_defaults = [p for p in run.param_results if p["name"].startswith("generation.")
                    and (p["name"], p["value"]) in BAD_DEFAULT_CONSTRAINTS]
    checks["bad default constraints refused"] = {
        "pass": (len(bad_defaults) >= len(BAD_DEFAULT_CONSTRAINTS)
                 and not any(p["ok"] or not p["reason"] for p in bad_defaults)),
        "detail": f"{len(bad_defaults)} sets; accepted or without a reason: "
                  f"{[p['name'] for p in bad_defaults if p['ok'] or not p['reason']][:5]}"}
    checks["cancel accepted -> CANCELED"] = {
        "pass": not bad_cancels, "detail": f"violations (index, point, status): {bad_cancels[:10]}"}
    checks["streamed == result"] = {"pass": not mismatched, "detail": f"mismatches: {mismatched[:10]}"}
    checks["same greedy output at the end"] = {
        "pass": run.golden_start == run.golden_end and not run.golden_start.startswith("<"),
        "detail": f"start {run.golden_start[:60]!r} end {run.golden_end[:60]!r}"}
    checks["transitions"] = {"pass": all(t["ok"] for t in run.transitions),
                             "detail": f"{len(run.transitions)} transitions"}
    checks["exit status 0"] = {"pass": run.exit_status == 0, "detail": f"exit status {run.exit_status}"}
    checks["dynamic cache valid"] = check_cache(args)
    if run.remote is not None:
        checks.update(run.remote.checks(records))
    report.metrics = metrics(run, args, rejected)
    m = report.metrics
    if run.remote is not None:
        m["remote_phase"] = run.remote.metrics()
    if args.max_rss_slope is not None:
        checks["RSS slope"] = {
            "pass": m["rss_slope_mib_per_1000_goals"] < args.max_rss_slope,
            "detail": f"{m['rss_slope_mib_per_1000_goals']:.2f} MiB per 1,000 goals after "
                      f"{args.warmup} goals (limit {args.max_rss_slope}); anonymous "
                      f"{m['rss_anon_slope_mib_per_1000_goals']:.2f}"}
    if args.cancel_bound:
        p99 = m["cancel_to_result_s"]["p99"] * 1000
        checks["cancel within a chunk + 2 steps"] = {
            "pass": p99 <= m["cancel_bound_ms"],
            "detail": f"p99 cancel-to-result {p99:.1f} ms; bound {m['cancel_bound_ms']:.1f} ms = "
                      f"chunk p99 {m['chunk_ms']['p99']:.1f} + 2 x step p99 {m['step_ms']['p99']:.1f}"}
    # Not a check of the server: rclpy's ActionClient can lose a goal response when the executor
    # handles it before send_goal_async registered the request (ros2/rclpy#1123, fixed upstream
    # in #1308 and its backports); the driver then logs "Ignoring unexpected goal response".
    m["goal_requests_unanswered"] = unanswered
    m["goal_responses_lost_by_client"] = sum(1 for r in records if r.response_lost)
    # the same race on the result request: answered only when asked again (GoalRun.wait_result)
    m["result_requests_unanswered"] = [r.index for r in records if r.result_resent]
    report.samples = [asdict(s) for s in run.samples]
    m["goal_records"] = [{k: v for k, v in asdict(r).items() if k not in ("streamed", "text")}
                         for r in records]
    return report


def timing_checks(records: Sequence[GoalRecord]) -> Dict[str, Dict[str, Any]]:
    """Every goal response within :data:`RESPONSE_BOUND`; every result within its budget +
    :data:`RESULT_MARGIN` (from the request: the budget counts from acceptance). A response the
    client lost (ros2/rclpy#1123; it found the goal accepted in the status later) is no measure
    of the server: counted apart."""
    answered = [r for r in records if r.accepted is not None and r.accepted_at and not r.response_lost]
    client_lost = sum(1 for r in records if r.response_lost)
    slow = [(r.index, r.kind, round(r.accepted_at - r.sent_at, 3)) for r in answered
            if r.accepted_at - r.sent_at > RESPONSE_BOUND]
    budgeted = [r for r in records if r.accepted and r.result_at and r.time_budget]
    late = [(r.index, r.kind, r.finish_reason, round(r.result_at - r.sent_at, 1), r.time_budget)
            for r in budgeted if r.result_at - r.sent_at > r.time_budget + RESULT_MARGIN]
    worst = max((r.accepted_at - r.sent_at for r in answered), default=math.nan)
    return {
        f"goal responses within {RESPONSE_BOUND:g} s": {
            "pass": not slow,
            "detail": f"{len(answered)} answered, slowest {worst:.3f} s; slower (index, kind, s): {slow[:10]}; "
                      f"{client_lost} responses lost by the client and found in the goal status"},
        f"results within budget + {RESULT_MARGIN:g} s": {
            "pass": not late,
            "detail": f"{len(budgeted)} results with a budget; late (index, kind, reason, s, budget): {late[:10]}"},
    }


def hostile_check(records: Sequence[GoalRecord]) -> Dict[str, Any]:
    """Each hostile kind was sent, and each such goal was refused or got its result (how they
    ended, by kind, in the detail)."""
    outcomes: Dict[str, Dict[str, int]] = {}
    unanswered = []
    for r in records:
        if not r.hostile:
            continue
        outcome = ("rejected" if r.accepted is False else r.finish_reason if r.result_at else "no result")
        by_kind = outcomes.setdefault(r.kind, {})
        by_kind[outcome] = by_kind.get(outcome, 0) + 1
        if outcome == "no result" or r.accepted is None:
            unanswered.append(r.index)
    return {"pass": not unanswered,  # a short run may send none: test_soak asserts it sends each kind
            "detail": f"{outcomes or 'none sent'}; without an answer or result: {unanswered[:10]}"}


def schema_check(records: Sequence[GoalRecord]) -> Dict[str, Any]:
    """Every schema goal that ended ``stop`` holds a JSON text valid for its schema (jsonschema)."""
    done = [r for r in records if r.json_schema and r.result_at]
    stopped = [r for r in done if r.finish_reason == "stop"]
    invalid = []
    for r in stopped:
        try:
            jsonschema.validate(json.loads(r.text), json.loads(r.json_schema))
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append((r.index, r.text[:40], str(exc).splitlines()[0][:80]))
    reasons: Dict[str, int] = {}
    for r in done:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return {"pass": not invalid,  # a short run may end none with stop: test_soak asserts some did
            "detail": f"{len(done)} ended {reasons}; {len(stopped)} stop results checked; not valid: {invalid[:5]}"}


def chat_calls_check(records: Sequence[GoalRecord]) -> Dict[str, Any]:
    """Every call of an accepted chat turn names an offered tool and its arguments validate against
    that tool's schema; a turn that had to call (required, a tool's name) and ended ``tool_calls``
    has calls, of the named tool where one was named."""
    turns = [r for r in records if r.chat and not r.invalid and not r.hostile and r.result_at]
    bad = []
    calls = 0
    for r in turns:
        tools = {t["function"]["name"]: t["function"].get("parameters", {}) for t in json.loads(r.tools or "[]")}
        if r.finish_reason == "tool_calls" and not r.tool_calls:
            bad.append((r.index, r.kind, "tool_calls without calls"))
        for name, arguments in r.tool_calls:
            calls += 1
            try:
                if name not in tools:
                    raise ValueError(f"calls {name!r}, not offered")
                if r.tool_choice not in ("required", "auto", "none", "") and name != r.tool_choice:
                    raise ValueError(f"calls {name!r}, {r.tool_choice!r} was named")
                jsonschema.validate(json.loads(arguments), tools[name])
            except (ValueError, jsonschema.ValidationError) as exc:
                bad.append((r.index, r.kind, str(exc).splitlines()[0][:80]))
    reasons: Dict[str, int] = {}
    for r in turns:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return {"pass": not bad, "detail": f"{len(turns)} turns ended {reasons}; {calls} calls checked; "
                                       f"not valid: {bad[:5]}"}


def fresh_check(run: SoakRun) -> Dict[str, Any]:
    """Every fresh-engine check (soak/fresh.py) passed: the node's answers were the fresh engine's
    text, or parted from it at a near-tie only."""
    failed = [(c["when"], [o for o in c["outcomes"] if o[1] != "same" and not o[1].startswith("near-tie")])
              for c in run.fresh_checks if not c["pass"]]
    ties = sum(1 for c in run.fresh_checks for _, o in c["outcomes"] if o.startswith("near-tie"))
    answers = sum(len(c["outcomes"]) for c in run.fresh_checks)
    return {"pass": bool(run.fresh_checks) and not failed,
            "detail": f"{len(run.fresh_checks)} checks ({', '.join(c['when'] for c in run.fresh_checks)}), "
                      f"{answers} answers, {ties} parted at a near-tie; failed: {failed[:3]}"}


def check_cache(args: argparse.Namespace) -> Dict[str, Any]:
    """The dynamic n-gram cache file the server wrote (``--set lookup.dynamic_path:=...``) reads back."""
    path = dict(item.split(":=", 1) for item in args.set).get("lookup.dynamic_path", "")
    if not path:
        return {"pass": True, "detail": "no lookup.dynamic_path override: not checked"}
    try:
        _, cache = learned_cache.read(os.path.expanduser(path))
    except Exception as exc:  # noqa: BLE001
        return {"pass": False, "detail": f"{path}: {exc}"}
    return {"pass": True, "detail": f"{path}: {len(cache)} n-grams"}


def metrics(run: SoakRun, args: argparse.Namespace, rejected: int) -> Dict[str, Any]:
    records: List[GoalRecord] = run.records
    samples = run.samples
    done = [r for r in records if r.result_at]
    latency = percentiles([r.result_at - r.sent_at for r in done])
    response = percentiles([r.accepted_at - r.sent_at for r in records
                            if r.accepted is not None and r.accepted_at and not r.response_lost])
    over_budget = percentiles([r.result_at - r.sent_at - r.time_budget for r in done if r.time_budget])
    cancel = percentiles([r.result_at - r.cancel_at for r in done if r.cancel_at])
    queue = percentiles([r.queue_wait for r in done])
    warm = [s for s in samples if s.goals_done >= args.warmup and s.serving]
    per_goal = slope([s.goals_done for s in warm], [s.rss_mib for s in warm])
    per_second = slope([s.t for s in warm], [s.rss_mib for s in warm])
    anon = slope([s.goals_done for s in warm], [s.rss_anon_mib for s in warm])
    # the last half of the run (by time), and RSS less the conversation snapshots' bounded store
    late = [s for s in samples if s.serving and samples and s.t >= samples[-1].t / 2]
    late_slope = slope([s.goals_done for s in late], [s.rss_mib for s in late])
    kept = [s for s in late if not math.isnan(s.conversations_mib)]
    late_less = slope([s.goals_done for s in kept], [s.rss_mib - s.conversations_mib for s in kept])
    step, chunk = percentiles([r.step_ms for r in done]), percentiles([r.chunk_ms for r in done])
    statuses: Dict[str, int] = {}
    for r in done:
        statuses[r.finish_reason or "?"] = statuses.get(r.finish_reason or "?", 0) + 1
    return {
        "seconds": run.seconds, "goals": len(records), "accepted": sum(1 for r in records if r.accepted),
        "rejected": rejected, "finish_reasons": statuses,
        "cancels": sum(1 for r in records if r.cancel_at),
        "latency_s": latency, "queue_wait_s": queue, "cancel_to_result_s": cancel,
        "goal_response_s": response, "result_minus_budget_s": over_budget,
        "hostile_sent": sum(1 for r in records if r.hostile),
        "schema_goals": sum(1 for r in records if r.json_schema),
        "schema_goals_stopped": sum(1 for r in done if r.json_schema and r.finish_reason == "stop"),
        "chat_goals": sum(1 for r in records if r.chat),
        "chat_goals_accepted": sum(1 for r in records if r.chat and r.accepted),
        "chat_calls": sum(len(r.tool_calls) for r in done if r.chat),
        "fresh_checks": run.fresh_checks,
        "rss_mib_first": samples[0].rss_mib if samples else math.nan,
        "rss_mib_last": samples[-1].rss_mib if samples else math.nan,
        "rss_slope_mib_per_1000_goals": per_goal * 1000,
        "rss_slope_mib_per_hour": per_second * 3600,
        "rss_anon_slope_mib_per_1000_goals": anon * 1000,
        "rss_slope_last_half_mib_per_1000_goals": late_slope * 1000,
        "rss_less_conversations_slope_last_half_mib_per_1000_goals": late_less * 1000,
        "conversations_mib_last": samples[-1].conversations_mib if samples else math.nan,
        "rss_anon_mib_first": samples[0].rss_anon_mib if samples else math.nan,
        "rss_anon_mib_last": samples[-1].rss_anon_mib if samples else math.nan,
        "rss_file_mib_last": samples[-1].rss_file_mib if samples else math.nan,
        "step_ms": step, "chunk_ms": chunk, "cancel_bound_ms": chunk["p99"] + 2 * step["p99"],
        "threads_slope_per_1000_goals": slope([s.goals_done for s in warm], [s.threads for s in warm]) * 1000,
        "open_files_slope_per_1000_goals": slope([s.goals_done for s in warm], [s.open_files for s in warm]) * 1000,
        "dynamic_cache_ngrams_last": samples[-1].ngrams if samples else 0,
        "error_log_lines": sum(1 for line in run.serve_log.splitlines() if "[ERROR]" in line or "[FATAL]" in line),
        "parameter_sets": len(run.param_results), "transitions": len(run.transitions),
    }


def render_markdown(report: Report) -> str:
    m = report.metrics
    lines = ["# gemma-spec-soak", "",
             f"{m['goals']} goals ({m['accepted']} accepted, {m['rejected']} rejected, {m['cancels']} "
             f"cancels) in {m['seconds']:.0f} s; {m['parameter_sets']} parameter sets, "
             f"{m['transitions']} transitions. Result: **{'PASS' if report.passed else 'FAIL'}**", "",
             "| check | result | detail |", "|---|---|---|"]
    for name, check in report.checks.items():
        lines.append(f"| {name} | {'PASS' if check['pass'] else 'FAIL'} | {check['detail']} |")
    lines += ["", "| measure | p50 | p95 | p99 | n |", "|---|---|---|---|---|"]
    for key, label in (("goal_response_s", "goal response (s)"), ("latency_s", "latency (s)"),
                       ("result_minus_budget_s", "result minus budget (s)"), ("queue_wait_s", "queue wait (s)"),
                       ("cancel_to_result_s", "cancel to result (s)"), ("step_ms", "target pass (ms)"),
                       ("chunk_ms", "prompt chunk (ms)")):
        p = m[key]
        lines.append(f"| {label} | {p['p50']:.3f} | {p['p95']:.3f} | {p['p99']:.3f} | {p['n']} |")
    lines += ["", "| resource | value |", "|---|---|",
              f"| RSS first / last (MiB) | {m['rss_mib_first']:.0f} / {m['rss_mib_last']:.0f} |",
              f"| RSS slope after warm-up (MiB per 1,000 goals) | {m['rss_slope_mib_per_1000_goals']:.2f} |",
              f"| RSS slope after warm-up (MiB per hour) | {m['rss_slope_mib_per_hour']:.2f} |",
              f"| RSS slope over the last half (MiB per 1,000 goals); less the conversation snapshots | "
              f"{m['rss_slope_last_half_mib_per_1000_goals']:.2f}; "
              f"{m['rss_less_conversations_slope_last_half_mib_per_1000_goals']:.2f} |",
              f"| conversation snapshots last (MiB; bounded by chat.conversation_cache_mb) | "
              f"{m['conversations_mib_last']:.1f} |",
              f"| anonymous RSS first / last (MiB) | {m['rss_anon_mib_first']:.0f} / {m['rss_anon_mib_last']:.0f} |",
              f"| anonymous RSS slope after warm-up (MiB per 1,000 goals) | "
              f"{m['rss_anon_slope_mib_per_1000_goals']:.2f} |",
              f"| file-backed RSS last (MiB; the model's mapped pages) | {m['rss_file_mib_last']:.0f} |",
              f"| threads slope (per 1,000 goals) | {m['threads_slope_per_1000_goals']:.2f} |",
              f"| open files slope (per 1,000 goals) | {m['open_files_slope_per_1000_goals']:.2f} |",
              f"| dynamic cache n-grams (last) | {m['dynamic_cache_ngrams_last']} |",
              f"| ERROR/FATAL log lines | {m['error_log_lines']} |",
              f"| goal requests without a response (client side, ros2/rclpy#1123) | "
              f"{len(m['goal_requests_unanswered'])} |",
              f"| goal responses lost by the client, the goal found accepted in its status (ros2/rclpy#1123) | "
              f"{m.get('goal_responses_lost_by_client', 0)} |",
              f"| result requests answered only when re-sent (client side, ros2/rclpy#1123) | "
              f"{len(m.get('result_requests_unanswered', []))} |",
              f"| finish reasons | {m['finish_reasons']} |"]
    return "\n".join(lines) + "\n"


def render_svg(samples: Sequence[Dict[str, Any]], width: int = 640, height: int = 240) -> str:
    """RSS (MiB) over time as a small dependency-free SVG line chart."""
    points = [(s["t"], s["rss_mib"]) for s in samples if not math.isnan(s["rss_mib"])]
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
    if len(points) < 2:
        return head + '<text x="10" y="20">fewer than 2 samples</text></svg>\n'
    t_max = max(t for t, _ in points) or 1.0
    low, high = min(r for _, r in points), max(r for _, r in points)
    span = (high - low) or 1.0

    def xy(t: float, r: float) -> str:
        return f"{40 + (width - 50) * t / t_max:.1f},{height - 30 - (height - 50) * (r - low) / span:.1f}"
    polyline = " ".join(xy(t, r) for t, r in points)
    return (head + f'<polyline fill="none" stroke="black" points="{polyline}"/>'
            f'<text x="5" y="15">RSS MiB {low:.0f}..{high:.0f}</text>'
            f'<text x="{width - 160}" y="{height - 8}">time 0..{t_max:.0f} s</text></svg>\n')
