"""Summaries, markdown tables and PNG plots of a bench run's records.

Input is the list of per-run records the bench writes to ``results.json`` (see ``bench.py``); every
figure here is derived from those records, so a committed results.json can be re-plotted with
``gemma-spec-bench --report-only DIR``.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .config import NO_REUSE_SUFFIX, REFERENCE_RUNNER
from .metrics import (RunKey, Spread, finite, parity_share, pooled_acceptance, ratio_by_prompt,
                            ratio_by_suite, same_run_ratios, spread)

Record = Mapping[str, Any]

PLOTS: Tuple[str, ...] = ("speedup_by_suite.png", "acceptance_by_position.png", "k_sweep.png",
                          "predicted_vs_measured.png")


def run_key(record: Record) -> RunKey:
    return (str(record["suite"]), str(record["prompt_id"]), int(record["repeat"]))


def rates_by_runner(records: Sequence[Record], field: str = "tokens_per_s") -> Dict[str, Dict[RunKey, float]]:
    """{runner: {(suite, prompt, repeat): value}} of successful runs."""
    out: Dict[str, Dict[RunKey, float]] = defaultdict(dict)
    for r in records:
        if not r.get("error") and finite(r.get(field)):
            out[str(r["runner"])][run_key(r)] = float(r[field])
    return dict(out)


def add_speedups(records: List[Dict[str, Any]], references: Mapping[str, str]) -> None:
    """Set each record's ``speedup`` (vs ``off``, same prompt and repeat) and ``speedup_vs_reference``
    (vs the runner's own reference, e.g. native-plain for native-lookup)."""
    rates = rates_by_runner(records)
    for r in records:
        key = run_key(r)
        value = rates.get(str(r["runner"]), {}).get(key)
        for field, ref in (("speedup", REFERENCE_RUNNER), ("speedup_vs_reference", references.get(str(r["runner"]), ""))):
            base = rates.get(ref, {}).get(key) if ref else None
            r[field] = value / base if finite(value) and finite(base) and base else None


def summarize(records: Sequence[Record], runners: Sequence[Mapping[str, Any]],
              suites: Sequence[str]) -> Dict[str, Any]:
    """Per-runner figures: speedup per suite (median, min, max over same-run per-prompt ratios),
    speedup against its own reference, rates, TTFT, tau, pooled acceptance, repetition, parity, RSS."""
    rates = rates_by_runner(records)
    hashes: Dict[str, Dict[RunKey, str]] = defaultdict(dict)
    for r in records:
        if not r.get("error") and r.get("output_hash"):
            hashes[str(r["runner"])][run_key(r)] = str(r["output_hash"])
    out: Dict[str, Any] = {"suites": list(suites), "runners": {}}
    for runner in runners:
        name = str(runner["name"])
        mine = [r for r in records if r["runner"] == name and not r.get("error")]
        stats = [r for r in mine if r.get("accepted_at") is not None]
        entry: Dict[str, Any] = {
            "kind": runner["kind"], "mode": runner["mode"], "k": runner["k"],
            "reference": runner.get("reference", ""),
            "runs": len(mine), "errors": sum(1 for r in records if r["runner"] == name and r.get("error")),
            "speedup": _spreads(ratio_by_suite(same_run_ratios(rates, name, REFERENCE_RUNNER), suites)),
            "tokens_per_s": spread(r.get("tokens_per_s") for r in mine).as_dict(),
            "e2e_tokens_per_s": spread(r.get("e2e_tokens_per_s") for r in mine).as_dict(),
            "ttft_ms": spread(_ms(r.get("ttft_s")) for r in mine).as_dict(),
            "tau": spread(r.get("tau") for r in mine).as_dict(),
            "acceptance_rate": spread(r.get("acceptance_rate") for r in mine).as_dict(),
            "acceptance_per_position": pooled_acceptance((r["accepted_at"] for r in stats),
                                                         (r["drafted_at"] for r in stats)),
            "repetition_4gram": spread(r.get("repetition_4gram") for r in mine).as_dict(),
            "parity_with_off": parity_share(hashes.get(name, {}), hashes.get(REFERENCE_RUNNER, {})),
            "predicted_speedup": spread(r.get("predicted_speedup") for r in mine).as_dict(),
            "peak_rss_mb": runner.get("peak_rss_mb"), "base_rss_mb": runner.get("base_rss_mb"),
            "step_profile": {field: spread(r.get(field) for r in mine).as_dict() for field in STEP_FIELDS},
        }
        ref = entry["reference"]
        if ref and (ref != REFERENCE_RUNNER or runner["kind"] == "action"):
            entry["vs_reference"] = _spreads(ratio_by_suite(same_run_ratios(rates, name, ref), suites))
        out["runners"][name] = entry
    out["vs_native"] = {f"{ours} / {native}": _spreads(ratio_by_suite(same_run_ratios(rates, ours, native), suites))
                        for ours, native in native_pairs(runners)}
    out["vs_best_fixed_k"] = {name: _spreads(ratio_by_suite(ratios, suites))
                              for name, ratios in versus_best_fixed_k(rates, runners).items()}
    oracle = versus_native_oracle(rates, runners)
    if oracle:
        out["vs_native_oracle"] = oracle
    return out


def native_drafting_runners(runners: Sequence[Mapping[str, Any]]) -> List[str]:
    """llama.cpp's runners that draft (every native runner but ``native-plain``)."""
    return [str(r["name"]) for r in runners if r["kind"] == "native" and r.get("draft_max") != 0]


def best_by_prompt(rates: Mapping[str, Mapping[RunKey, float]],
                   candidates: Sequence[str]) -> Dict[Tuple[str, str], str]:
    """Per (suite, prompt): the candidate runner with the highest median tokens/s over the repeats
    (not each repeat's maximum, which would pick noise), among those that have a rate there."""
    prompts = {(s, p) for c in candidates for (s, p, _) in rates.get(c, {})}
    best: Dict[Tuple[str, str], str] = {}
    for prompt in prompts:
        medians = {c: statistics.median(v for (s, p, _), v in rates.get(c, {}).items() if (s, p) == prompt)
                   for c in candidates if any((s, p) == prompt for (s, p, _) in rates.get(c, {}))}
        if medians:
            best[prompt] = max(medians, key=lambda c: (medians[c], c))
    return best


def versus_native_oracle(rates: Mapping[str, Mapping[RunKey, float]],
                         runners: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Each of our lookup runners (``lookup``/``auto``, any K, and ``off``) against the best of
    llama.cpp's drafting runners *per prompt* (the native oracle of ``--native-sweep``; needs >= 2).

    The oracle of a prompt is the native runner with the highest median tokens/s over the repeats;
    our ratio on a (prompt, repeat) is ours / that runner's on the same repeat, and a prompt's figure
    is the median over its repeats. Returns {"winners": {"suite/prompt": runner}, "runners": {ours:
    {"per_prompt": {"suite/prompt": ratio}, "median", "geomean", "min", "worst", "n"}}}.

    >>> runners = [{"name": "lookup", "kind": "engine", "mode": "lookup", "draft_max": None},
    ...            {"name": "native-plain", "kind": "native", "mode": "lookup", "draft_max": 0},
    ...            {"name": "native-lookup/K3", "kind": "native", "mode": "lookup", "draft_max": 3},
    ...            {"name": "native-ngram-simple", "kind": "native", "mode": "speculative-ngram",
    ...             "draft_max": None}]
    >>> rates = {"lookup": {("s", "a", 0): 50.0, ("s", "b", 0): 30.0},
    ...          "native-plain": {("s", "a", 0): 90.0, ("s", "b", 0): 90.0},
    ...          "native-lookup/K3": {("s", "a", 0): 40.0, ("s", "b", 0): 40.0},
    ...          "native-ngram-simple": {("s", "a", 0): 25.0, ("s", "b", 0): 60.0}}
    >>> result = versus_native_oracle(rates, runners)
    >>> result["winners"]
    {'s/a': 'native-lookup/K3', 's/b': 'native-ngram-simple'}
    >>> mine = result["runners"]["lookup"]
    >>> mine["per_prompt"], mine["median"], round(mine["geomean"], 3), mine["worst"]
    ({'s/a': 1.25, 's/b': 0.5}, 0.875, 0.791, 's/b')
    """
    natives = native_drafting_runners(runners)
    if len(natives) < 2:
        return {}
    best = best_by_prompt(rates, natives)
    ours = [str(r["name"]) for r in runners if r["kind"] == "engine"
            and r["mode"] in ("lookup", "auto", REFERENCE_RUNNER) and not str(r["name"]).endswith(NO_REUSE_SUFFIX)]
    result: Dict[str, Any] = {"winners": {f"{s}/{p}": best[(s, p)] for s, p in sorted(best)}, "runners": {}}
    for name in ours:
        per_prompt: Dict[str, float] = {}
        for (suite, prompt), oracle in sorted(best.items()):
            ratios = same_run_ratios({"a": {k: v for k, v in rates.get(name, {}).items() if k[:2] == (suite, prompt)},
                                      "b": rates.get(oracle, {})}, "a", "b")
            if ratios:
                per_prompt[f"{suite}/{prompt}"] = statistics.median(ratios.values())
        if not per_prompt:
            continue
        values = list(per_prompt.values())
        worst = min(per_prompt, key=lambda k: per_prompt[k])
        result["runners"][name] = {
            "per_prompt": per_prompt, "n": len(values), "median": statistics.median(values),
            "geomean": math.exp(sum(math.log(v) for v in values) / len(values)),
            "min": per_prompt[worst], "worst": worst,
            "below_0_85": sum(1 for v in values if v < 0.85)}
    return result


#: Per-run step profile fields (ms per target pass after the first token; see cli.step_profile).
STEP_FIELDS = ("steps", "step_ms", "draft_step_ms", "verify_step_ms", "sample_step_ms", "other_step_ms")


def native_pairs(runners: Sequence[Mapping[str, Any]]) -> List[Tuple[str, str]]:
    """(our runner, llama.cpp's runner) pairs to compare in absolute tokens/s: every engine runner of
    a lookup mode against every ``native-lookup/K*``, every ``mtp`` runner against every
    ``native-spec-mtp/K*``, and ``off`` against ``native-plain``."""
    names = {str(r["name"]): r for r in runners}
    native = [n for n, r in names.items() if r["kind"] == "native" and r["mode"] == "lookup" and r.get("draft_max")]
    pairs = [(n, m) for n, r in names.items() if r["kind"] == "engine" and r["mode"] in ("lookup", "auto")
             and not n.endswith(NO_REUSE_SUFFIX) for m in native]
    mtp_native = [n for n, r in names.items() if r["kind"] == "native" and r["mode"] == "speculative-mtp"]
    pairs += [(n, m) for n, r in names.items() if r["kind"] == "engine" and r["mode"] == "mtp"
              and not n.endswith(NO_REUSE_SUFFIX) for m in mtp_native]  # MTP: same pair, same K
    if REFERENCE_RUNNER in names and "native-plain" in names:
        pairs.append((REFERENCE_RUNNER, "native-plain"))
    return pairs


def versus_best_fixed_k(rates: Mapping[str, Mapping[RunKey, float]],
                        runners: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[RunKey, float]]:
    """Per adaptive engine runner: its tokens/s over the best fixed-K runner of the same mode on the
    same (prompt, repeat) — the oracle a K sweep gives (needs >= 2 fixed K in the run). The best K of
    a prompt is the one with the highest median over the repeats (not each repeat's maximum, which
    would pick noise and favour the oracle).

    >>> runners = [{"name": "lookup", "kind": "engine", "mode": "lookup", "draft_max": None},
    ...            {"name": "lookup/K2", "kind": "engine", "mode": "lookup", "draft_max": 2},
    ...            {"name": "lookup/K4", "kind": "engine", "mode": "lookup", "draft_max": 4}]
    >>> rates = {"lookup": {("s", "a", 0): 45.0, ("s", "a", 1): 44.0},
    ...          "lookup/K2": {("s", "a", 0): 40.0, ("s", "a", 1): 46.0},
    ...          "lookup/K4": {("s", "a", 0): 50.0, ("s", "a", 1): 44.0}}
    >>> versus_best_fixed_k(rates, runners)
    {'lookup': {('s', 'a', 0): 0.9, ('s', 'a', 1): 1.0}}
    """
    out: Dict[str, Dict[RunKey, float]] = {}
    for runner in runners:
        if runner["kind"] != "engine" or runner.get("draft_max") is not None or runner["mode"] == "off":
            continue
        name = str(runner["name"])
        fixed = [str(r["name"]) for r in runners if r["kind"] == "engine" and r["mode"] == runner["mode"]
                 and r.get("draft_max") is not None and r.get("reuse_prompt", True) == runner.get("reuse_prompt", True)]
        if len(fixed) < 2:
            continue
        best: Dict[Tuple[str, str], str] = {}
        for prompt in {(s, p) for (s, p, _) in rates.get(name, {})}:
            medians = {f: statistics.median(v for (s, p, _), v in rates.get(f, {}).items() if (s, p) == prompt)
                       for f in fixed if any((s, p) == prompt for (s, p, _) in rates.get(f, {}))}
            if len(medians) == len(fixed):
                best[prompt] = max(medians, key=lambda f: medians[f])
        ratios: Dict[RunKey, float] = {}
        for key, value in rates.get(name, {}).items():
            oracle = best.get((key[0], key[1]))
            base = rates.get(oracle, {}).get(key) if oracle else None
            if finite(base) and base > 0:
                ratios[key] = value / base
        out[name] = ratios
    return out


def _ms(seconds: Optional[float]) -> Optional[float]:
    return seconds * 1e3 if finite(seconds) else None


def _spreads(by_suite: Mapping[str, Spread]) -> Dict[str, Dict[str, float]]:
    return {k: v.as_dict() for k, v in by_suite.items()}


def _fmt(d: Optional[Mapping[str, float]], unit: str = "x", digits: int = 2) -> str:
    if not d or not d.get("n"):
        return "-"
    return Spread(d["median"], d["min"], d["max"], int(d["n"])).format(unit, digits)


def _num(value: Any, digits: int = 2, unit: str = "") -> str:
    return f"{value:.{digits}f}{unit}" if finite(value) else "-"


# -- markdown --------------------------------------------------------------------------------------
def markdown(results: Mapping[str, Any]) -> str:
    """The tables of a run: speedup per suite, per-runner figures, runner-vs-own-baseline ratios."""
    summary = results["summary"]
    suites: List[str] = summary["suites"]
    runners: Dict[str, Any] = summary["runners"]
    cfg = results["config"]
    lines = [f"# Bench results ({results['created']})", "",
             f"Target `{Path(str(cfg['target'])).name}`"
             + (f", draft `{Path(str(cfg['draft'])).name}`" if cfg.get("draft") else ", no draft model")
             + f"; {cfg['max_tokens']} tokens, temperature {cfg['temperature']}"
             + (f" (seed {cfg['seed']})" if cfg["temperature"] else " (greedy)")
             + f", {cfg['repeats']} repeat(s), {results['machine']['cpu_count']} CPU threads available,"
             f" {cfg['threads']} used{_build_line(cfg)}. {_load_line(results)}", ""]
    lines += ["## Speedup vs `off`", "",
              "Decode tokens/s of each runner divided by `off`'s on the same prompt in the same repeat; "
              "median over prompts x repeats, (min-max) of those ratios.", ""]
    header = ["runner", "K"] + suites + ["all"]
    lines += [_row(header), _row(["---"] * len(header))]
    for name, e in runners.items():
        lines.append(_row([f"`{name}`", str(e["k"])] + [_fmt(e["speedup"].get(s)) for s in suites + ["all"]]))
    lines += ["", "## Per runner", "",
              "tokens/s: decode rate, median (min-max) over runs. TTFT: request start to first output. "
              "tau: mean acceptance length (1 + accepted/drafts). acc.: accepted/drafted per run. "
              "rep.: share of repeated 4-grams of the output. parity: share of outputs identical to `off`'s. "
              "RSS: peak resident set of the runner's own process (base = with llama_cpp imported, before loading models).", ""]
    header = ["runner", "tokens/s", "TTFT ms", "tau", "acc.", "rep.", "parity", "peak RSS MiB",
              "base MiB", "errors"]
    lines += [_row(header), _row(["---"] * len(header))]
    for name, e in runners.items():
        lines.append(_row([
            f"`{name}`", _fmt(e["tokens_per_s"], "", 1), _fmt(e["ttft_ms"], "", 0), _fmt(e["tau"], "", 2),
            _fmt(e["acceptance_rate"], "", 2), _fmt(e["repetition_4gram"], "", 2),
            _num(e["parity_with_off"], 2), _num(e["peak_rss_mb"], 0), _num(e["base_rss_mb"], 0),
            str(e["errors"])]))
    pairs = [(n, e) for n, e in runners.items() if "vs_reference" in e]
    overhead = _overhead(results)
    if pairs or overhead:
        lines += ["", "## Against their own baseline", "",
                  "Same-run ratio of a runner to its own plain counterpart (native-lookup vs native-plain, "
                  "llama-cpp-python prompt lookup vs its plain generation, the action vs the in-process "
                  "engine in the same mode) and of `off` to llama-cpp-python's plain generation.", ""]
        header = ["runner", "vs"] + suites + ["all"]
        lines += [_row(header), _row(["---"] * len(header))]
        for name, e in pairs:
            lines.append(_row([f"`{name}`", f"`{e['reference']}`"]
                              + [_fmt(e["vs_reference"].get(s)) for s in suites + ["all"]]))
        if overhead:
            lines.append(_row(["`off`", "`lcp-plain`"] + [_fmt(overhead.get(s)) for s in suites + ["all"]]))
    ttff = _ttft_ratios(results)
    if ttff:
        lines += ["", "Time to first feedback through the action vs the engine's TTFT in-process "
                  "(median ms, same prompts):", ""]
        lines += [_row(["runner", "TTFF ms (action)", "TTFT ms (engine)"]), _row(["---"] * 3)]
        lines += [_row([f"`{n}`", _num(a, 0), _num(b, 0)]) for n, (a, b) in ttff.items()]
    lines += _versus_lines(summary, suites)
    lines += _oracle_lines(results)
    lines += _step_profile_lines(runners)
    lines += _prompt_reuse_lines(results)
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


def _versus_lines(summary: Mapping[str, Any], suites: Sequence[str]) -> List[str]:
    lines: List[str] = []
    for key, title, text in (
            ("vs_native", "Against llama.cpp's own tools (absolute tokens/s)",
             "Same-run ratio of our runner's decode tokens/s to llama.cpp's on the same prompt and repeat "
             "(> 1: ours faster)."),
            ("vs_best_fixed_k", "Adaptive K against the best fixed K",
             "Same-run ratio of the adaptive runner's tokens/s to the fastest fixed-K runner of its mode "
             "on each prompt and repeat (the oracle of the K sweep; 1.00 = the policy found the best K).")):
        table = summary.get(key) or {}
        if not table:
            continue
        header = ["runners"] + list(suites) + ["all"]
        lines += ["", f"## {title}", "", text, "", _row(header), _row(["---"] * len(header))]
        lines += [_row([f"`{name}`"] + [_fmt(by.get(s)) for s in list(suites) + ["all"]])
                  for name, by in table.items()]
    return lines


def _oracle_lines(results: Mapping[str, Any]) -> List[str]:
    """The "ours vs the best native setting per prompt" tables (``--native-sweep``)."""
    oracle = results["summary"].get("vs_native_oracle") or {}
    if not oracle.get("runners"):
        return []
    rates = rates_by_runner(results["runs"])
    names = list(oracle["runners"])
    lines = ["", "## Ours vs the best native setting per prompt", "",
             "The oracle of a prompt: the fastest of llama.cpp's drafting runners on it (median tokens/s "
             "over the repeats); ratio = our tokens/s / the oracle's, same prompt and repeat (median over "
             "repeats). Summary over prompts: median, geometric mean, worst prompt, prompts below 0.85x.", ""]
    header = ["runner", "prompts", "median", "geomean", "worst", "below 0.85x"]
    lines += [_row(header), _row(["---"] * len(header))]
    for name in names:
        e = oracle["runners"][name]
        lines.append(_row([f"`{name}`", str(e["n"]), f"{e['median']:.2f}x", f"{e['geomean']:.2f}x",
                           f"{e['min']:.2f}x ({e['worst']})", str(e["below_0_85"])]))
    header = ["prompt", "winner", "winner tok/s"] + [f"`{n}`" for n in names]
    lines += ["", _row(header), _row(["---"] * len(header))]
    for prompt, winner in oracle["winners"].items():
        suite, prompt_id = prompt.split("/", 1)
        values = [v for (s, p, _), v in rates.get(winner, {}).items() if (s, p) == (suite, prompt_id)]
        cells = [_num(oracle["runners"][n]["per_prompt"].get(prompt), 2, "x") for n in names]
        lines.append(_row([prompt, f"`{winner}`", _num(statistics.median(values) if values else None, 1)]
                          + cells))
    counts: Dict[str, int] = defaultdict(int)
    for winner in oracle["winners"].values():
        counts[winner] += 1
    lines += ["", "Wins per native setting: " + ", ".join(
        f"`{w}` {n}" for w, n in sorted(counts.items(), key=lambda item: -item[1])) + "."]
    return lines


def _step_profile_lines(runners: Mapping[str, Any]) -> List[str]:
    rows = [(name, e["step_profile"]) for name, e in runners.items()
            if (e.get("step_profile") or {}).get("step_ms", {}).get("n")]
    if not rows:
        return []
    lines = ["", "## Step profile", "",
             "Milliseconds per target pass after the first token, median over runs: the whole step "
             "(decode wall time / passes), drafting, the target's decode (verify; llama.cpp tools: "
             "llama_perf's eval time), sampling and acceptance, and the rest (cache updates, text, "
             "stats; for llama.cpp's tools all but the decode). passes: target passes per run.", ""]
    header = ["runner", "passes", "step", "draft", "verify", "sample", "other"]
    lines += [_row(header), _row(["---"] * len(header))]
    for name, prof in rows:
        cells = [_num(prof[f]["median"] if prof[f].get("n") else None, 0 if f == "steps" else 2)
                 for f in STEP_FIELDS]
        lines.append(_row([f"`{name}`"] + cells))
    return lines


def prompt_reuse_pairs(results: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Per (runner, suite, prompt): median TTFT and total latency with prompt reuse and without
    (the ``<runner>/no-reuse`` twin of ``--prompt-reuse both``) over the repeats, and their ratios."""
    by_key: Dict[Tuple[str, str, str], Dict[str, List[Tuple[float, float]]]] = {}
    for r in results["runs"]:
        if not finite(r.get("ttft_s")) or not finite(r.get("wall_s")):
            continue
        name = str(r["runner"])
        base, reuse = (name[:-len(NO_REUSE_SUFFIX)], "off") if name.endswith(NO_REUSE_SUFFIX) else (name, "on")
        entry = by_key.setdefault((base, str(r["suite"]), str(r["prompt_id"])), {"on": [], "off": []})
        entry[reuse].append((float(r["ttft_s"]), float(r["wall_s"])))
    rows = []
    for (runner, suite, prompt_id), entry in by_key.items():
        if not entry["on"] or not entry["off"]:
            continue
        ttft_on, ttft_off = (statistics.median(t for t, _ in entry[k]) for k in ("on", "off"))
        wall_on, wall_off = (statistics.median(w for _, w in entry[k]) for k in ("on", "off"))
        rows.append({"runner": runner, "suite": suite, "prompt_id": prompt_id,
                     "ttft_ms_reuse": ttft_on * 1e3, "ttft_ms_no_reuse": ttft_off * 1e3,
                     "ttft_ratio": ttft_on / ttft_off if ttft_off else math.nan,
                     "latency_s_reuse": wall_on, "latency_s_no_reuse": wall_off,
                     "latency_ratio": wall_on / wall_off if wall_off else math.nan})
    return rows


def _prompt_reuse_lines(results: Mapping[str, Any]) -> List[str]:
    rows = prompt_reuse_pairs(results)
    if not rows:
        return []
    lines = ["", "## Prompt reuse", "",
             "Each engine runner with prompt reuse (the node's default) against its `/no-reuse` twin "
             "(every prompt evaluated whole), same prompts, same run; medians over repeats. The first "
             "prompt a runner serves in a repeat has nothing to reuse. ratio = with / without.", ""]
    header = ["runner", "prompt", "TTFT ms with", "TTFT ms without", "TTFT ratio", "latency s with",
              "latency s without", "latency ratio"]
    lines += [_row(header), _row(["---"] * len(header))]
    for r in rows:
        lines.append(_row([f"`{r['runner']}`", f"{r['suite']}/{r['prompt_id']}", _num(r["ttft_ms_reuse"], 0),
                           _num(r["ttft_ms_no_reuse"], 0), _num(r["ttft_ratio"], 3),
                           _num(r["latency_s_reuse"], 2), _num(r["latency_s_no_reuse"], 2),
                           _num(r["latency_ratio"], 2)]))
    return lines


def markdown_per_prompt(results: Mapping[str, Any]) -> str:
    """Speedup vs ``off`` per prompt: median (min-max over repeats), one row per prompt."""
    records = results["runs"]
    rates = rates_by_runner(records)
    names = [n for n in results["summary"]["runners"] if n != REFERENCE_RUNNER]
    per = {n: ratio_by_prompt(same_run_ratios(rates, n, REFERENCE_RUNNER)) for n in names}
    reps: Dict[Tuple[str, str], Spread] = defaultdict(lambda: spread([]))
    off = [r for r in records if r["runner"] == REFERENCE_RUNNER and not r.get("error")]
    for key in {(r["suite"], r["prompt_id"]) for r in off}:
        reps[key] = spread(r.get("repetition_4gram") for r in off if (r["suite"], r["prompt_id"]) == key)
    keys = sorted({k for table in per.values() for k in table},
                  key=lambda k: (results["summary"]["suites"].index(k[0]), k[1]))
    header = ["suite", "prompt", "rep. (off)"] + [f"`{n}`" for n in names]
    lines = ["# Speedup vs `off` per prompt", "", "Median (min-max) over repeats of the same-run ratio; "
             "rep. = share of repeated 4-grams in `off`'s output.", "", _row(header), _row(["---"] * len(header))]
    for k in keys:
        lines.append(_row([k[0], k[1], reps[k].format("", 2)] + [per[n].get(k, spread([])).format() for n in names]))
    return "\n".join(lines) + "\n"


def _build_line(cfg: Dict[str, Any]) -> str:
    """``; llama.cpp build fast, flash attention on`` where the results say (older ones do not)."""
    parts = []
    if cfg.get("llama_build"):
        parts.append(f"llama.cpp build `{cfg['llama_build']}`")
    if cfg.get("flash_attn") is not None:
        parts.append("flash attention " + ("on" if cfg["flash_attn"] else "off"))
    return ("; " + ", ".join(parts)) if parts else ""


def _load_line(results: Mapping[str, Any]) -> str:
    """The machine's 1-minute load average during the runs: other work on the CPUs is noise."""
    loads = spread(r.get("loadavg_1m") for r in results["runs"])
    cpus = results["machine"].get("cpu_count") or 1
    if not loads.n:
        return ""
    busy = sum(1 for r in results["runs"] if finite(r.get("loadavg_1m")) and r["loadavg_1m"] > cpus + 0.5)
    return (f"1-minute load average at the runs' start: median {loads.median:.1f} "
            f"(min {loads.low:.1f}, max {loads.high:.1f}); {busy} of {loads.n} runs started with more "
            f"than {cpus} CPUs' worth of load, i.e. while other work competed for the cores.")


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _overhead(results: Mapping[str, Any]) -> Dict[str, Dict[str, float]]:
    rates = rates_by_runner(results["runs"])
    if "lcp-plain" not in rates or REFERENCE_RUNNER not in rates:
        return {}
    return _spreads(ratio_by_suite(same_run_ratios(rates, REFERENCE_RUNNER, "lcp-plain"),
                                   results["summary"]["suites"]))


def _ttft_ratios(results: Mapping[str, Any]) -> Dict[str, Tuple[float, float]]:
    runners = results["summary"]["runners"]
    return {n: (e["ttft_ms"]["median"], runners[e["reference"]]["ttft_ms"]["median"])
            for n, e in runners.items() if e["kind"] == "action" and e["reference"] in runners}


# -- plots -----------------------------------------------------------------------------------------
def plot_all(results: Mapping[str, Any], out_dir: Path) -> List[Path]:
    """Write the four PNGs (see PLOTS) into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in zip(PLOTS, (_plot_speedup, _plot_acceptance, _plot_k_sweep, _plot_predicted)):
        fig = draw(results, plt)
        path = out_dir / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _title(results: Mapping[str, Any]) -> str:
    cfg = results["config"]
    temp = "greedy" if not cfg["temperature"] else f"T={cfg['temperature']}"
    return f"{Path(str(cfg['target'])).name}, {cfg['max_tokens']} tokens, {temp}"


def _plot_speedup(results: Mapping[str, Any], plt: Any) -> Any:
    runners = {n: e for n, e in results["summary"]["runners"].items() if n != REFERENCE_RUNNER}
    groups = results["summary"]["suites"] + ["all"]
    fig, ax = plt.subplots(figsize=(min(12.0, max(7.0, 0.35 * len(groups) * max(1, len(runners)))), 4.5))
    width = 0.8 / max(1, len(runners))
    for i, (name, e) in enumerate(runners.items()):
        xs, ys, lo, hi = [], [], [], []
        for g, suite in enumerate(groups):
            d = e["speedup"].get(suite)
            if d and d.get("n"):
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(d["median"])
                lo.append(d["median"] - d["min"])
                hi.append(d["max"] - d["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel("tokens/s ratio vs off (median, min-max)")
    ax.set_title(f"Speedup per suite - {_title(results)}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def _plot_acceptance(results: Mapping[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    drawn = 0
    for name, e in results["summary"]["runners"].items():
        acc = e.get("acceptance_per_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no drafts in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("acceptance rate (pooled over runs)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance per draft position - {_title(results)}", fontsize=10)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_k_sweep(results: Mapping[str, Any], plt: Any) -> Any:
    fig, (ax_tau, ax_rate) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    by_mode: Dict[str, List[Tuple[int, Dict[str, Any]]]] = defaultdict(list)
    for name, e in results["summary"]["runners"].items():
        if e["kind"] in ("engine", "native") and str(e["k"]).isdigit() and int(e["k"]) > 0:
            by_mode[f"{e['kind']}:{e['mode']}" if e["kind"] == "native" else e["mode"]].append((int(e["k"]), e))
    off = results["summary"]["runners"].get(REFERENCE_RUNNER, {}).get("tokens_per_s", {})
    for mode, points in sorted(by_mode.items()):
        points.sort(key=lambda p: p[0])
        ks = [k for k, _ in points]
        ax_tau.plot(ks, [e["tau"]["median"] for _, e in points], marker="o", label=mode)
        ax_rate.plot(ks, [e["tokens_per_s"]["median"] for _, e in points], marker="o", label=mode)
    if off.get("n"):
        ax_rate.axhline(off["median"], color="black", linewidth=0.8, linestyle="--", label="off")
    if not by_mode:
        for ax in (ax_tau, ax_rate):
            ax.text(0.5, 0.5, "no fixed-K runs (use --k 1,2,3,4,8)", ha="center", va="center",
                    transform=ax.transAxes)
    for ax in (ax_tau, ax_rate):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_tau.set_xlabel("K (draft length)")
    ax_tau.set_ylabel("tau (median)")
    ax_rate.set_xlabel("K (draft length)")
    ax_rate.set_ylabel("decode tokens/s (median)")
    for ax in (ax_tau, ax_rate):
        if by_mode:
            ax.legend(fontsize=7)
    fig.suptitle(f"tau and tokens/s against K - {_title(results)}", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_predicted(results: Mapping[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    points: Dict[str, Tuple[List[float], List[float]]] = defaultdict(lambda: ([], []))
    for r in results["runs"]:
        if (r["runner"] != REFERENCE_RUNNER and not r.get("error") and finite(r.get("predicted_speedup"))
                and finite(r.get("speedup"))):
            xs, ys = points[str(r["runner"])]
            xs.append(float(r["predicted_speedup"]))
            ys.append(float(r["speedup"]))
    for name, (xs, ys) in sorted(points.items()):
        ax.scatter(xs, ys, s=12, alpha=0.7, label=name)
    values = [v for xs, ys in points.values() for v in xs + ys]
    top = max(values + [2.0])
    ax.plot([0, top], [0, top], color="black", linewidth=0.8)
    if not points:
        ax.text(0.5, 0.5, "no predicted speedups in this run", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.set_xlabel("predicted speedup (engine's policy)")
    ax.set_ylabel("measured speedup vs off (same run)")
    ax.set_title(f"Predicted vs measured - {_title(results)}", fontsize=10)
    fig.tight_layout()
    return fig


def json_ready(value: Any, digits: int = 6) -> Any:
    """NaN and inf to None and floats to ``digits`` significant digits, recursively: strict,
    compact JSON (timings are not meaningful past a few digits).

    >>> json_ready({"a": [float("nan"), 1.23456789, 2]})
    {'a': [None, 1.23457, 2]}
    """
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v, digits) for v in value]
    return value


def dump_results(results: Mapping[str, Any]) -> str:
    """results.json text: the head indented, then one line per run (small, and diffs read well)."""
    clean = json_ready(dict(results))
    runs = clean.pop("runs", [])
    head = json.dumps(clean, indent=1, allow_nan=False)
    lines = ",\n".join("  " + json.dumps(r, separators=(",", ":"), allow_nan=False) for r in runs)
    return head[:-2] + ',\n "runs": [\n' + lines + "\n ]\n}\n"


__all__ = ["PLOTS", "add_speedups", "dump_results", "json_ready", "markdown", "markdown_per_prompt",
           "plot_all", "rates_by_runner", "summarize"]
