"""Replay drafters over a trace's reference outputs, in order, with modelled pass costs: how each
drafting strategy would fare on a multi-request trace, in seconds of CPU, unmoved by a busy host.

Greedy decoding makes the accepted tokens a function of the drafts. For each request of the trace,
in order, each strategy drafts as the engine does (:func:`~gemma_spec_ros.engine.propose.propose`
with the real drafters, their draft-length policies, the per-draft cut, and under a schema the real
grammar: forced text first, drafts cut before the first refused token); a draft is accepted up to
its first mismatch with the reference output, and the pass is charged the cost of its rows
(``--pass-ms``; drafting time is reported apart, and charged with ``--charge-drafting``). The
drafters and policies live across the requests, as in one engine: what a request's output teaches
the history (or the learned n-gram cache) serves the next requests.

Printed per strategy: the modelled speedup over plain decoding per request and its median over the
requests after the first five (the traces' acceptance figure), the median of its per-request ratio
to the first strategy's, and the tokens per pass.

    python -m gemma_spec_dev.bench.trace_replay --trace planner --outputs /tmp/planner_free.json
    python -m gemma_spec_dev.bench.trace_replay --trace planner --constrained \\
        --outputs /tmp/planner_json.json --strategies lookup,suffix,suffix+lookup

The reference outputs are generated once (greedy, with the pass costs the engine calibrates on this
host) and kept in ``--outputs``; later replays read them and take seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from gemma_spec_ros.engine.modes import MODES
from gemma_spec_ros.engine.propose import GRAMMAR_DRAFT_MAX, GRAMMAR_K, Drafting, DraftRequest, propose
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.grammar.matcher import Grammar, GrammarVocab, compiled_constraint
from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
from gemma_spec_ros.engine.policy.costs import CostModel
from gemma_spec_ros.engine.policy.length import DraftLengthPolicy
from gemma_spec_ros.engine.stats import SpecStats
from gemma_spec_ros.engine.drafters.suffix import SuffixDrafter
from gemma_spec_ros.engine.drafters.base import Drafter
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import LookupConfig, SpecConfig, SuffixConfig
from gemma_spec_ros.engine.policy.hindsight import DraftHindsight
from .config import default_params, engine_config, load_params
from .trace_requests import TRACES, TraceRequest, trace_requests

#: Requests a trace's median leaves out: the first ones, before any history.
WARM_REQUESTS = 5
#: Pass sizes the reference run calibrates (a draft of up to 32 tokens + the pending one).
CALIBRATED_ROWS = 33
#: Milliseconds per target pass by rows (``--pass-ms`` takes a name of this table, or sizes):
#:
#: - ``trace-fit`` (the default): fitted to the passes of the timed planner trace (quiet host, the
#:   engine runners' 144 requests: V(n) = 15.9 ms + 7.41 ms per row past the first, 5 % residual);
#: - ``decode-shape``: the shape timed outside Python (docs/design.md, "A verify pass is not free on
#:   a CPU": even row counts cheaper than the odd one below) at the same one-row cost.
#:
#: The earlier default (llama.cpp's step profile, a 9-row pass 2.2 one-row passes) charged a row
#: past the first a third of what the timed trace shows, and so favoured long drafts.
#: A busy host's calibration is no shape to charge (one measured 450 ms for 1 row and 3100 for 13).
PASS_TABLES: Dict[str, str] = {
    "trace-fit": "1:15.9,33:253.0",
    "decode-shape": "1:15.9,2:23.4,3:39.1,4:33.9,5:49.9,6:42.6,7:54.5,8:59.8,9:74.9,10:65.3,12:74.1,"
                    "13:83.0,16:93.7,17:122.9,33:237.0",
}
DEFAULT_PASS_TABLE = "trace-fit"


def pass_costs(text: str, max_rows: int = CALIBRATED_ROWS) -> Dict[int, float]:
    """``"1:20,4:27.6,9:43.6"`` -> ms for every size 1..max_rows, linear between the sizes given
    and flat past the last.

    >>> pass_costs("1:20,3:30", 4)
    {1: 20.0, 2: 25.0, 3: 30.0, 4: 30.0}
    """
    given = sorted((int(rows), float(ms)) for rows, ms in (item.split(":") for item in text.split(",")))
    costs = {}
    for rows in range(1, max_rows + 1):
        below = [g for g in given if g[0] <= rows] or given[:1]
        above = [g for g in given if g[0] >= rows] or given[-1:]
        (r0, m0), (r1, m1) = below[-1], above[0]
        costs[rows] = m0 if r1 == r0 else m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
    return costs


#: The drafters a replay has: no model.
REPLAYED_DRAFTERS = ("lookup", "suffix")


@dataclass(frozen=True)
class Strategy:
    """A mode of the engine's table (its chain of drafters, tried in order) and their settings."""

    name: str
    mode: str  # a row of modes.MODES whose drafters are all REPLAYED_DRAFTERS
    suffix: SuffixConfig = SuffixConfig()
    draft_max: int = 12  # K (spec.draft_max)

    @property
    def chain(self) -> Tuple[str, ...]:
        return MODES[self.mode].chain


def replayable_modes() -> List[str]:
    """The table's modes a replay runs: no model needed, and a drafter of :data:`REPLAYED_DRAFTERS`
    in the chain (the others are passed over, as in an engine without them loaded: ``auto``)."""
    return [m.name for m in MODES.values() if not m.needs and any(d in REPLAYED_DRAFTERS for d in m.chain)]


def traced_pass_ms(trace: Mapping[str, Any], min_passes: int = 5) -> str:
    """The pass costs a timed trace's engine runners measured (``trace.json`` of :mod:`.trace`), as
    ``--pass-ms`` sizes: per rows, the median over the runners' medians, sizes timed at least
    ``min_passes`` times by one runner."""
    medians: Dict[int, List[float]] = {}
    for info in trace.get("runners", {}).values():
        for rows, figure in (info.get("pass_ms") or {}).items():
            if figure["passes"] >= min_passes:
                medians.setdefault(int(rows), []).append(figure["median_ms"])
    if 1 not in medians:
        raise ValueError("the trace recorded no one-row passes of an engine runner (pass_ms)")
    return ",".join(f"{rows}:{statistics.median(ms):.2f}" for rows, ms in sorted(medians.items()))


def replay_pass_ms(choice: str, saved: Mapping[str, Any]) -> Dict[int, float]:
    """``--pass-ms``: a table's name, sizes, ``measured`` (the reference run's calibration) or the
    path of a timed trace's ``trace.json``."""
    if choice == "measured":
        return {int(n): ms for n, ms in saved["pass_ms"].items()}
    if choice.endswith(".json"):
        return pass_costs(traced_pass_ms(json.loads(Path(choice).read_text())))
    return pass_costs(PASS_TABLES.get(choice, choice))


def parse_strategies(text: str, suffix_variants: Mapping[str, SuffixConfig], draft_max: int) -> List[Strategy]:
    """``lookup,suffix,suffix+lookup,suffix[f2]/K16`` -> strategies: a mode of the table,
    ``[name]`` picks a suffix variant (``--suffix-variant``), ``/K<n>`` sets K."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        body, _, k = item.partition("/K")
        variant = SuffixConfig()
        if "[" in body:
            before, _, rest = body.partition("[")
            name, _, after = rest.partition("]")
            body = before + after
            if name not in suffix_variants:
                raise ValueError(f"strategy {item}: no suffix variant {name!r} (--suffix-variant)")
            variant = suffix_variants[name]
        if body not in replayable_modes():
            raise ValueError(f"strategy {item}: {body!r} is not a mode of the table that runs with only "
                             f"{' and '.join(REPLAYED_DRAFTERS)} (one of {', '.join(replayable_modes())})")
        out.append(Strategy(item, body, variant, int(k) if k else draft_max))
    return out


def parse_suffix_variant(text: str) -> Tuple[str, SuffixConfig]:
    """``f2:match_factor=2,min_token_probability=0.2`` -> ("f2", SuffixConfig(...))."""
    name, _, assignments = text.partition(":")
    fields: Dict[str, Any] = {}
    for assignment in filter(None, assignments.split(",")):
        key, _, value = assignment.partition("=")
        default = getattr(SuffixConfig(), key)
        fields[key] = (value.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)(value)
    return name, SuffixConfig(**fields)


class ReplayCosts(CostModel):
    """The cost model of a replay: the pass costs charged, and no drafting cost. The engine's model
    learns drafting times as it measures them, but measured here they would make the policy's
    choices, and so the replay's figures, depend on the host's load (an n-gram draft costs ~0.1 ms
    against a 20 ms pass: 2-3 % apart between two replays of the same outputs on a busy host)."""

    def observe_draft_time(self, source: str, n_tokens: int, seconds: float) -> None:
        """Not learned (class docstring)."""


class Replayer:
    """One strategy's drafters and policies, alive across the requests of the trace."""

    def __init__(self, strategy: Strategy, pass_ms: Mapping[int, float], charge_drafting: bool = False) -> None:
        self.strategy = strategy
        self.pass_ms = pass_ms
        self.charge_drafting = charge_drafting
        self.costs = ReplayCosts()
        for rows, ms in sorted(pass_ms.items()):
            self.costs.observe_verify(rows, ms / 1e3)
        self.drafters: Dict[str, Drafting] = {}
        for name in [d for d in strategy.chain if d in REPLAYED_DRAFTERS]:
            drafter: Drafter = (LookupDrafter(LookupConfig()) if name == "lookup"
                                else SuffixDrafter(strategy.suffix))
            self.drafters[name] = Drafting(drafter, DraftLengthPolicy(name, self.costs))
        self.mode = strategy.mode
        self.spec = SpecConfig(mode=strategy.mode, draft_max=strategy.draft_max)

    def replay(self, prompt: Sequence[int], out: Sequence[int],
               grammar: Optional[Grammar]) -> Dict[str, float]:
        """One request: modelled seconds after the first token, its speedup and tokens per pass."""
        policies = {name: d.policy for name, d in self.drafters.items()}
        for drafting in self.drafters.values():
            drafting.drafter.begin(prompt)
            drafting.policy.new_request()
        uncut, stats = DraftHindsight(policies), SpecStats()
        if grammar is not None:
            grammar.accept(out[0])
        context, i, seconds, passes, draft_s = list(prompt) + [out[0]], 1, 0.0, 0, 0.0
        while i < len(out):
            hard_cap = len(out) - i - 1
            k_cap = min(self.spec.draft_max if grammar is None else max(self.spec.draft_max, GRAMMAR_K),
                        hard_cap)
            if uncut.pending:
                uncut.settle(out[:i])
            started, emitted = time.perf_counter(), i
            proposal = propose(self.drafters, self.costs, DraftRequest(
                self.mode, self.spec, context, k_cap, min(GRAMMAR_DRAFT_MAX, hard_cap), grammar, cut=True))
            for whole in proposal.wholes:
                uncut.add(whole, emitted + proposal.n_forced)
            stats.num_grammar_cut_tokens += proposal.n_cut
            draft, n_forced = proposal.draft, proposal.n_forced
            draft_s += time.perf_counter() - started
            accepted = 0
            while accepted < len(draft) and draft.tokens[accepted] == out[i + accepted]:
                accepted += 1
            own = len(draft) - n_forced
            if own > 0 and accepted >= n_forced:
                self.drafters[draft.source].policy.observe(own, accepted - n_forced)
            new = list(out[i:i + accepted + 1])
            if grammar is not None:
                grammar.advance(new)
            seconds += self.pass_ms[1 + len(draft)] / 1e3
            passes += 1
            context.extend(new)
            i += len(new)
        for drafting in self.drafters.values():
            drafting.drafter.end(context)
        plain = (len(out) - 1) * self.pass_ms[1] / 1e3
        seconds += draft_s if self.charge_drafting else 0.0
        return {"speedup": plain / seconds if seconds else 1.0,
                "tokens_per_pass": (len(out) - 1) / passes if passes else 1.0,
                "draft_ms_per_pass": 1e3 * draft_s / passes if passes else 0.0}


def generate_outputs(params: Mapping[str, Any], requests: Sequence[TraceRequest], max_tokens: int,
                     mode: str) -> Dict[str, Any]:
    """Greedy outputs of ``requests`` in order (with ``mode``: greedy speculative output is the
    plain one up to near-ties of quantized logits) and the pass costs calibrated on this host."""
    config = engine_config(params, mode, None)
    with Engine(config, calibrate=False) as engine:
        engine.calibrate(sizes=range(1, CALIBRATED_ROWS + 1))
        pass_ms = {n: 1e3 * engine.costs.verify_cost(n) for n in range(1, CALIBRATED_ROWS + 1)}
        texts = []
        for request in requests:
            generation = GenerationRequest(prompt=request.prompt, max_tokens=max_tokens, spec_mode=mode,
                                           json_schema=request.json_schema)
            out = [t for step in engine.generate(generation) for t in step.tokens]
            texts.append({"id": request.id, "prompt": engine.prompt_tokens(generation), "out": out})
    return {"pass_ms": pass_ms, "texts": texts, "max_tokens": max_tokens}


def _grammar_factory(params: Mapping[str, Any], schema: str) -> Callable[[], Optional[Grammar]]:
    """Fresh grammar states of ``schema`` for the embedded model's vocabulary ('' = none)."""
    if not schema:
        return lambda: None
    from gemma_spec_ros.engine.llama.model import LlamaModel

    target = LlamaModel(engine_config(params, "off", None).target)
    vocab = GrammarVocab.of(target)
    constraint = compiled_constraint("", schema)

    def start() -> Grammar:
        assert target.n_vocab > 0  # the vocabulary lives as long as the model: keep it referenced
        return vocab.start(constraint)

    return start


def replay_all(saved: Mapping[str, Any], strategies: Sequence[Strategy], pass_ms: Mapping[int, float],
               new_grammar: Callable[[], Optional[Grammar]],
               charge_drafting: bool = False) -> Dict[str, List[Dict[str, float]]]:
    """Every strategy over every request of ``saved`` in order (the requests interleaved)."""
    replayers = [Replayer(s, pass_ms, charge_drafting) for s in strategies]
    figures: Dict[str, List[Dict[str, float]]] = {s.name: [] for s in strategies}
    for text in saved["texts"]:
        for replayer in replayers:
            grammar = new_grammar()
            try:
                figures[replayer.strategy.name].append(replayer.replay(text["prompt"], text["out"], grammar))
            finally:
                if grammar is not None:
                    grammar.close()
    return figures


def median_after_warm(values: Sequence[float]) -> float:
    """The median over the requests after the first :data:`WARM_REQUESTS`."""
    rest = list(values[WARM_REQUESTS:]) or list(values)
    return statistics.median(rest)


def report(saved: Mapping[str, Any], figures: Mapping[str, List[Dict[str, float]]]) -> str:
    names = list(figures)
    lines = ["request".ljust(12) + "".join(n[:16].rjust(17) for n in names)]
    for index, text in enumerate(saved["texts"]):
        lines.append(text["id"].ljust(12) + "".join(f"{figures[n][index]['speedup']:17.2f}" for n in names))
    lines.append("median>5".ljust(12) + "".join(
        f"{median_after_warm([f['speedup'] for f in figures[n]]):17.3f}" for n in names))
    lines.append("tok/pass".ljust(12) + "".join(
        f"{median_after_warm([f['tokens_per_pass'] for f in figures[n]]):17.2f}" for n in names))
    lines.append(f"vs {names[0][:8]}".ljust(12) + "".join(
        f"{median_after_warm([f['speedup'] / b['speedup'] for f, b in zip(figures[n], figures[names[0]])]):17.3f}"
        for n in names))
    lines.append("draft ms".ljust(12) + "".join(
        f"{median_after_warm([f['draft_ms_per_pass'] for f in figures[n]]):17.3f}" for n in names))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=TRACES, default="planner")
    parser.add_argument("--constrained", action="store_true", help="with the plan schema (planner)")
    parser.add_argument("--config", default="", help="node params file (default: the embedded config)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--outputs", required=True,
                        help="JSON file of the reference outputs and pass costs: read if it exists, "
                             "else generated and written")
    parser.add_argument("--reference-mode", default="lookup",
                        help="mode that generates the reference outputs (greedy)")
    parser.add_argument("--strategies", default="lookup,suffix,suffix+lookup")
    parser.add_argument("--suffix-variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="a named SuffixConfig for strategies such as suffix[NAME]")
    parser.add_argument("--draft-max", type=int, default=0, help="K (default: the config's)")
    parser.add_argument("--charge-drafting", action="store_true",
                        help="add the measured drafting time to the modelled seconds (a busy host "
                             "inflates it: by default it is only reported, as 'draft ms')")
    parser.add_argument("--pass-ms", default=DEFAULT_PASS_TABLE,
                        help=f"ms per pass by rows: a table ({', '.join(PASS_TABLES)}), sizes such as "
                             "1:20,4:27.6,9:43.6 (interpolated), 'measured' for the costs calibrated "
                             "with the reference outputs, or a timed trace's trace.json (bench.trace: "
                             "the passes its engine runners timed)")
    args = parser.parse_args(argv)
    params = load_params(args.config) if args.config else default_params()
    requests = trace_requests(args.trace, args.constrained)
    path = Path(args.outputs)
    if path.is_file():
        saved = json.loads(path.read_text())
    else:
        saved = generate_outputs(params, requests, args.max_tokens, args.reference_mode)
        path.write_text(json.dumps(saved))
    draft_max = args.draft_max or engine_config(params, "lookup", None).spec.draft_max
    variants = dict(parse_suffix_variant(v) for v in args.suffix_variant)
    strategies = parse_strategies(args.strategies, variants, draft_max)
    pass_ms = replay_pass_ms(args.pass_ms, saved)
    figures = replay_all(saved, strategies, pass_ms, _grammar_factory(params, requests[0].json_schema),
                         args.charge_drafting)
    print(report(saved, figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
