"""The figures of a bench run, all derived from its per-run records (results.json's ``runs``):
same-run speedups, the per-runner summary, the comparisons against the native tools' best setting
and against the best fixed K."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import NO_REUSE_SUFFIX, REFERENCE_RUNNER
from ..metrics import (RunKey, Spread, finite, parity_share, pooled_acceptance, ratio_by_suite,
                       same_run_ratios, spread)

Record = Mapping[str, Any]


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
        for field, ref in (("speedup", REFERENCE_RUNNER),
                           ("speedup_vs_reference", references.get(str(r["runner"]), ""))):
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
            "speedup": spreads_by_suite(ratio_by_suite(same_run_ratios(rates, name, REFERENCE_RUNNER), suites)),
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
            entry["vs_reference"] = spreads_by_suite(ratio_by_suite(same_run_ratios(rates, name, ref), suites))
        out["runners"][name] = entry
    out["vs_native"] = {f"{ours} / {native}":
                        spreads_by_suite(ratio_by_suite(same_run_ratios(rates, ours, native), suites))
                        for ours, native in native_pairs(runners)}
    out["vs_best_fixed_k"] = {name: spreads_by_suite(ratio_by_suite(ratios, suites))
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


def same_text_as_off(records: Sequence[Record]) -> Dict[Tuple[str, str], Dict[str, bool]]:
    """{(suite, prompt): {runner: whether its text is ``off``'s}} from the texts the bench keeps
    (every runner's first repeat). llama.cpp's tools may write a few tokens past the request, so
    one text being the start of the other counts as the same. A faster runner with another text
    is faster partly by its text: on the fast build near-ties resolve differently by batch shape,
    and a continuation that repeats itself is easier to draft (see docs/benchmarks.md).

    >>> rows = [{"suite": "s", "prompt_id": "a", "repeat": 0, "runner": "off", "text": "one two"},
    ...         {"suite": "s", "prompt_id": "a", "repeat": 0, "runner": "x", "text": "one two three"},
    ...         {"suite": "s", "prompt_id": "a", "repeat": 0, "runner": "y", "text": "one too"},
    ...         {"suite": "s", "prompt_id": "a", "repeat": 0, "runner": "z", "text": None}]
    >>> same_text_as_off(rows)
    {('s', 'a'): {'off': True, 'x': True, 'y': False}}
    """
    texts: Dict[Tuple[str, str], Dict[str, str]] = defaultdict(dict)
    for r in records:
        if int(r["repeat"]) == 0 and not r.get("error") and r.get("text"):
            texts[(str(r["suite"]), str(r["prompt_id"]))][str(r["runner"])] = str(r["text"])
    out: Dict[Tuple[str, str], Dict[str, bool]] = {}
    for prompt, by_runner in texts.items():
        off = by_runner.get(REFERENCE_RUNNER)
        if off:
            out[prompt] = {name: text.startswith(off) or off.startswith(text) for name, text in by_runner.items()}
    return out


#: Per-run step profile fields (ms per target pass after the first token; see record.step_profile).
STEP_FIELDS = ("steps", "step_ms", "draft_step_ms", "verify_step_ms", "sample_step_ms", "other_step_ms")


def native_pairs(runners: Sequence[Mapping[str, Any]]) -> List[Tuple[str, str]]:
    """(our runner, llama.cpp's runner) pairs to compare in absolute tokens/s: every engine runner of
    a lookup mode against every ``native-lookup/K*``, every ``mtp`` runner against every
    ``native-spec-mtp/K*`` (``eagle3`` against ``native-spec-eagle3/K*``), and ``off`` against
    ``native-plain``."""
    names = {str(r["name"]): r for r in runners}
    native = [n for n, r in names.items() if r["kind"] == "native" and r["mode"] == "lookup" and r.get("draft_max")]
    pairs = [(n, m) for n, r in names.items() if r["kind"] == "engine" and r["mode"] in ("lookup", "auto")
             and not n.endswith(NO_REUSE_SUFFIX) for m in native]
    for mode in ("mtp", "eagle3"):  # a linked drafter and llama.cpp's draft-<mode>: same pair, same K
        linked = [n for n, r in names.items() if r["kind"] == "native" and r["mode"] == f"speculative-{mode}"]
        pairs += [(n, m) for n, r in names.items() if r["kind"] == "engine" and r["mode"] == mode
                  and not n.endswith(NO_REUSE_SUFFIX) for m in linked]
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


def spreads_by_suite(by_suite: Mapping[str, Spread]) -> Dict[str, Dict[str, float]]:
    return {k: v.as_dict() for k, v in by_suite.items()}
