"""Replay lookup drafting strategies on greedy reference outputs: no timing, so a busy host cannot
skew it (docs/benchmarks.md, "Levers tried and dropped").

Greedy decoding makes the accepted tokens a function of the drafts: each step the real LookupDrafter
proposes (its length chosen by the real DraftLengthPolicy, or fixed), the draft is accepted up to its
first mismatch with `off`'s output, and the pass is charged PASS_MS[rows]. Prints the modelled
speedup over plain decoding per prompt and strategy.

    .venv/bin/python scripts/lookup_replay.py --random-prompts 10 --seed 20261202

``--persistent`` keeps one drafter and policy per strategy across the prompts, as one engine (one
bench runner) does; ``--config`` / ``--target`` replay another setup (the exact build's F16 copy:
run with ``PYTHONPATH=.venv/opt/llama-cpp-exact``); ``--measured-costs`` charges the pass costs the
engine calibrates on this host; ``--outputs FILE`` keeps the reference outputs (and those costs), so
strategies can be compared again in seconds. The exact build's 27 prompts of the oracle run:

    PYTHONPATH=.venv/opt/llama-cpp-exact .venv/bin/python scripts/lookup_replay.py \
        --config exact12.yaml --target ~/.cache/gemma_spec_ros/models/gemma-3-270m-f16.gguf \
        --prompts-per-suite 1 --random-prompts 20 --seed 20261203 --measured-costs \
        --outputs /tmp/exact_out.json --persistent
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
from gemma_spec_ros.engine.policy.costs import CostModel
from gemma_spec_ros.engine.policy.length import DraftLengthPolicy
from gemma_spec_ros.engine.policy.hindsight import DraftHindsight
from gemma_spec_ros.engine.drafters.base import Draft
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import LookupConfig, SamplingParams
from gemma_spec_dev.bench.config import (apply_overrides, default_params, engine_config, find_data_dir,
                                         load_params, load_suites)
from gemma_spec_dev.bench.corpus import default_corpus, random_suite

#: name -> (cap on K, adaptive[, cut each draft]). A<n>: the policy chooses one K <= n before
#: drafting; C<n>: every step drafts up to n and the policy cuts the draft (the engine's policy,
#: K = n); K<n>: always n.
STRATEGIES: Dict[str, Tuple] = {"A4": (4, True), "C6": (6, True, True), "C8": (8, True, True),
                                "C12": (12, True, True), "C16": (16, True, True),
                                "K3": (3, False), "K4": (4, False), "K5": (5, False), "K8": (8, False),
                                "K12": (12, False)}


class Replayer:
    """One strategy's drafter and policy; with ``persistent`` they carry over from prompt to prompt as
    in one engine (the policy's estimates, the dynamic cache), else each prompt starts afresh."""

    def __init__(self, cap: int, adaptive: bool, cut: bool = False, persistent: bool = False) -> None:
        self.cap, self.adaptive, self.cut, self.persistent = cap, adaptive, cut, persistent
        self.policy, self.drafter = self._fresh()

    def _fresh(self) -> Tuple[DraftLengthPolicy, LookupDrafter]:
        costs = CostModel()
        for rows, ms in sorted(PASS_MS.items()):
            costs.observe_verify(rows, ms / 1e3)
        return DraftLengthPolicy("lookup", costs), LookupDrafter(LookupConfig())

    def replay(self, prompt: Sequence[int], out: Sequence[int]) -> float:
        """Modelled speedup on one reference output (the first token is the prompt's)."""
        if not self.persistent:
            self.policy, self.drafter = self._fresh()
        policy, drafter, cap = self.policy, self.drafter, self.cap
        policies = {"lookup": policy}
        policy.new_request()
        drafter.begin(prompt)
        context, i, seconds = list(prompt) + list(out[:1]), 1, 0.0
        uncut = DraftHindsight(policies)
        while i < len(out):
            k_cap = min(cap, len(out) - i - 1)
            if self.cut:  # as the engine does (drafting.propose): draft up to the cap, keep it whole, cut it
                uncut.settle(out[:i])
                whole = drafter.propose(context, k_cap) if k_cap > 0 else Draft()
                uncut.add(whole, i)
                draft = whole.tokens[:policy.cut(whole.evidence).draft_len] if whole.tokens else ()
            else:
                k = policy.decide(k_cap, self.adaptive).draft_len if k_cap > 0 else 0
                draft = drafter.propose(context, k).tokens if k else ()
            accepted = 0
            while accepted < len(draft) and draft[accepted] == out[i + accepted]:
                accepted += 1
            if draft:
                policy.observe(len(draft), accepted)
            seconds += PASS_MS[1 + len(draft)] / 1e3
            n = min(accepted + 1, len(out) - i)
            context.extend(out[i:i + n])
            i += n
        drafter.end(context)
        return (len(out) - 1) * PASS_MS[1] / 1e3 / seconds


def pass_costs(spec: str, max_rows: int) -> Dict[int, float]:
    """``"1:18.9,4:39"`` -> ms for every pass size 1..max_rows: linear between the sizes given, and
    past the last along the slope of the last two."""
    given = sorted((int(rows), float(ms)) for rows, ms in (item.split(":") for item in spec.split(",")))
    costs: Dict[int, float] = {}
    for rows in range(1, max_rows + 1):
        lower = max((g for g in given if g[0] <= rows), default=given[0])
        upper = min((g for g in given if g[0] >= rows), default=None)
        if upper is None:  # past the last: the last two's slope
            (r0, m0), (r1, m1) = given[-2] if len(given) > 1 else given[-1], given[-1]
            costs[rows] = m1 + (rows - r1) * ((m1 - m0) / (r1 - r0) if r1 != r0 else 0.0)
        elif upper[0] == lower[0]:
            costs[rows] = lower[1]
        else:
            costs[rows] = lower[1] + (rows - lower[0]) * (upper[1] - lower[1]) / (upper[0] - lower[0])
    return costs


#: ms per target pass by rows: llama.cpp's own pass costs of the embedded model (Q4_K_M) on the 2-core
#: CPU, timed outside Python by scripts/decode_timing.c (docs/design.md, "Numerical facts"); the
#: sizes not timed are interpolated. Even row counts are cheaper than the odd one below them.
LLAMA_CPP_PASS_MS = ("1:20.1,2:29.5,3:49.5,4:42.8,5:63.2,6:53.8,7:69.0,8:75.6,9:94.8,10:82.7,12:93.7,"
                     "13:105.0,16:118.4,17:155.4")
PASS_MS: Dict[int, float] = pass_costs(LLAMA_CPP_PASS_MS, max_rows=17)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-per-suite", type=int, default=2)
    parser.add_argument("--random-prompts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pass-ms", default="",
                        help="pass costs to charge, e.g. 1:18.9,2:29,4:39 (ms by rows; sizes not given "
                             "are interpolated, past the last extrapolated): default PASS_MS")
    parser.add_argument("--config", default="", help="node params file (default: the embedded config)")
    parser.add_argument("--target", default="", help="target model path over the config's")
    parser.add_argument("--measured-costs", action="store_true",
                        help="charge the pass costs the engine calibrates on this host (not PASS_MS)")
    parser.add_argument("--persistent", action="store_true",
                        help="one drafter and policy per strategy across all prompts, as in one engine")
    parser.add_argument("--outputs", default="",
                        help="JSON file of the reference outputs (and measured pass costs): read if it "
                             "exists, else written after generating them")
    args = parser.parse_args()
    params = apply_overrides(load_params(args.config) if args.config else default_params(), args.target, "")
    if args.pass_ms:
        PASS_MS.clear()
        PASS_MS.update(pass_costs(args.pass_ms, max_rows=max(v[0] for v in STRATEGIES.values()) + 1))
    prompts_dir = find_data_dir("prompts")
    prompts = [(f"{s.name}/{p.id}", p.text) for s in load_suites(prompts_dir) for p in s.prompts[:args.prompts_per_suite]]
    if args.random_prompts:
        suite = random_suite(args.random_prompts, default_corpus(), args.seed, exclude=[prompts_dir])
        prompts += [(f"random/{p.id}", p.text) for p in suite.prompts]
    results: List[Tuple[str, Dict[str, float]]] = []
    replayers: Dict[str, Replayer] = {}
    saved = json.loads(Path(args.outputs).read_text()) if args.outputs and Path(args.outputs).is_file() else None
    if saved is None:  # greedy reference outputs (and, if asked, this host's pass costs)
        saved = {"pass_ms": None, "texts": []}
        with Engine(engine_config(params, "off", None), calibrate=False) as engine:
            if args.measured_costs:
                rows = max(v[0] for v in STRATEGIES.values()) + 1
                engine.calibrate(sizes=range(1, rows + 1))
                saved["pass_ms"] = {n: 1e3 * engine.costs.verify_cost(n) for n in range(1, rows + 1)}
            for name, text in prompts:
                request = GenerationRequest(prompt=text, max_tokens=args.max_tokens, spec_mode="off",
                                            sampling=SamplingParams(temperature=0.0))
                out = [t for step in engine.generate(request) for t in step.tokens]
                saved["texts"].append([name, engine.prompt_tokens(request), out])
        if args.outputs:
            Path(args.outputs).write_text(json.dumps(saved))
    if args.measured_costs and saved["pass_ms"]:
        PASS_MS.clear()
        PASS_MS.update({int(n): ms for n, ms in saved["pass_ms"].items()})
        print("pass ms:", " ".join(f"{n}:{ms:.1f}" for n, ms in PASS_MS.items()))
    replayers = {s: Replayer(*v, persistent=args.persistent) for s, v in STRATEGIES.items()}
    for name, prompt, out in saved["texts"]:
        if len(out) >= 8:
            results.append((name, {s: replayers[s].replay(prompt, out) for s in STRATEGIES}))
    print("prompt".ljust(60) + "".join(s.rjust(7) for s in STRATEGIES))
    for name, figures in results:
        print(name[-60:].ljust(60) + "".join(f"{figures[s]:7.2f}" for s in STRATEGIES))
    fixed = [s for s, v in STRATEGIES.items() if not v[1]]
    for s in STRATEGIES:
        values = [f[s] for _, f in results]
        best = [f[s] / max(f[k] for k in fixed) for _, f in results]
        print(f"{s}: median {statistics.median(values):.3f}, geomean "
              f"{math.exp(statistics.fmean(map(math.log, values))):.3f}, vs best fixed K median "
              f"{statistics.median(best):.3f} min {min(best):.3f}")


if __name__ == "__main__":
    main()
