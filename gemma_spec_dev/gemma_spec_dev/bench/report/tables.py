"""The markdown of a bench run: results.md (speedup per suite, per-runner figures, the comparisons)
and results_per_prompt.md, from results.json as written."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import NO_REUSE_SUFFIX, REFERENCE_RUNNER
from ..metrics import Spread, finite, ratio_by_prompt, ratio_by_suite, same_run_ratios, spread
from .summary import STEP_FIELDS, rates_by_runner, same_text_as_off, spreads_by_suite


def _fmt(d: Optional[Mapping[str, float]], unit: str = "x", digits: int = 2) -> str:
    if not d or not d.get("n"):
        return "-"
    return Spread(d["median"], d["min"], d["max"], int(d["n"])).format(unit, digits)


def _num(value: Any, digits: int = 2, unit: str = "") -> str:
    return f"{value:.{digits}f}{unit}" if finite(value) else "-"


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
              "RSS: peak resident set of the runner's own process "
              "(base = with llama_cpp imported, before loading models).", ""]
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
    same = same_text_as_off(results["runs"])
    header = ["prompt", "winner", "winner tok/s", "same text"] + [f"`{n}`" for n in names]
    lines += ["", _row(header), _row(["---"] * len(header))]
    counted = {n: [0, 0] for n in ["winner"] + names}  # [same as off, known] over prompts
    for prompt, winner in oracle["winners"].items():
        suite, prompt_id = prompt.split("/", 1)
        values = [v for (s, p, _), v in rates.get(winner, {}).items() if (s, p) == (suite, prompt_id)]
        cells = [_num(oracle["runners"][n]["per_prompt"].get(prompt), 2, "x") for n in names]
        agree = same.get((suite, prompt_id), {})
        for n, runner in [("winner", winner)] + [(n, n) for n in names]:
            if runner in agree:
                counted[n][0] += agree[runner]
                counted[n][1] += 1
        text = ("yes" if agree[winner] else "no") if winner in agree else "-"
        lines.append(_row([prompt, f"`{winner}`", _num(statistics.median(values) if values else None, 1), text]
                          + cells))
    if counted["winner"][1]:
        tallies = [f"{'the winners' if n == 'winner' else f'`{n}`'} {c[0]} of {c[1]}"
                   for n, c in counted.items() if c[1]]
        lines += ["", "same text: whether the winner wrote `off`'s text (first repeat; one text the start "
                  "of the other). Prompts with `off`'s text: " + ", ".join(tallies) + ". A runner with "
                  "another text is faster or slower partly by its text, not only by its drafting."]
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
    return spreads_by_suite(ratio_by_suite(same_run_ratios(rates, REFERENCE_RUNNER, "lcp-plain"),
                                           results["summary"]["suites"]))


def _ttft_ratios(results: Mapping[str, Any]) -> Dict[str, Tuple[float, float]]:
    runners = results["summary"]["runners"]
    return {n: (e["ttft_ms"]["median"], runners[e["reference"]]["ttft_ms"]["median"])
            for n, e in runners.items() if e["kind"] == "action" and e["reference"] in runners}
