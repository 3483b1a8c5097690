"""A multi-request trace, timed: every runner gets the trace's requests in order, same run.

    python -m gemma_spec_dev.bench.trace --trace planner --out bench_trace/planner_free
    python -m gemma_spec_dev.bench.trace --trace planner --constrained --out bench_trace/planner_json
    python -m gemma_spec_dev.bench.trace --trace agent --max-tokens 400 --out bench_trace/agent

The traces (:mod:`.trace_requests`): a robot planner's 36 instructions under one system prompt
(with or without the plan schema), and an agent loop editing one file over 16 turns. A client sends
them one after the other, so whatever a runner learns from a request may serve the next ones.

Runners, interleaved request by request (each request: every runner once, the order rotating):

- our engine, one instance per runner for the whole trace (the node's defaults of the params file:
  adaptive K, prompt reuse), in a mode of its table: ``off``, ``lookup`` (the n-gram caches, the
  learned one in memory), ``suffix`` (the suffix drafter, its history in memory), ``suffix+lookup``
  (suffix first, then lookup);
- ``llama-lookup/K<k>``: llama.cpp's lookup tool, started for each request, its dynamic n-gram cache
  (``-lcd``) one file for the whole trace, read and written by every request in order;
- ``llama-server/<setting>``: one llama-server per n-gram setting of llama.cpp (``--spec-type`` and
  its sizes, as the bench's ``--native-sweep``), started once for the whole trace, prompt caching on
  (llama-server's default ``cache_prompt``), ``-lcd`` for its ``ngram-cache`` type; and
  ``llama-server/none``, its plain decoding.

Figures: decode tokens/s of each request (tokens after the first / time after the first, the same
definition for every runner), per request the ratio to ``off`` and to ``lookup``, and their medians
over the requests after the first five (the traces' acceptance figures). Writes ``trace.json`` and
``trace.md`` into ``--out``. The machine may be shared: the ratios are same-run ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from gemma_spec_ros.engine import modes
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.config import SuffixConfig
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import SamplingParams, SpecConfig, expand_path
from .constrained import LlamaServer
from .config import (NATIVE_NGRAM_SETTINGS, RunnerSpec, default_params, engine_config, load_params,
                     model_config, thread_count)
from .native import NativeRunner
from .record import make_record
from .runner import RunResult, Timeline, stats_dict
from .trace_replay import WARM_REQUESTS
from .trace_requests import TRACES, TraceRequest, trace_requests

#: Engine runners by default: modes of the engine's table (modes.py).
ENGINE_MODES: Tuple[str, ...] = ("off", "lookup", "suffix", "suffix+lookup")
#: llama-lookup's draft lengths by default (its best n-gram setting on the single-prompt suites).
LOOKUP_TOOL_KS: Tuple[int, ...] = (3, 8)
#: llama-server settings by default: plain decoding and each n-gram method (NATIVE_NGRAM_SETTINGS).
SERVER_SETTINGS: Tuple[str, ...] = ("none", "ngram-cache", "ngram-simple/n3m8", "ngram-map-k/n3m8",
                                    "ngram-mod/n4")
SEED = 1234


class EngineTraceRunner:
    """Our engine in one mode of its table for the whole trace (its suffix history in memory)."""

    def __init__(self, name: str, params: Mapping[str, Any], suffix: SuffixConfig) -> None:
        self.name, self._mode = name, name
        config = dataclasses.replace(engine_config(params, name, None), suffix=suffix)
        self._engine = Engine(config)
        self.info = {"spec": repr(self._engine.spec), "chain": list(modes.MODES[name].chain)}
        self.passes: Dict[int, List[float]] = {}  # seconds of the target's passes by rows, as timed
        observe = self._engine.costs.observe_verify

        def observe_and_keep(n_rows: int, seconds: float) -> None:
            self.passes.setdefault(n_rows, []).append(seconds)
            observe(n_rows, seconds)

        self._engine.costs.observe_verify = observe_and_keep  # type: ignore[method-assign]

    def run(self, request: TraceRequest, max_tokens: int) -> RunResult:
        generation = GenerationRequest(prompt=request.prompt, max_tokens=max_tokens, spec_mode=self._mode,
                                       sampling=SamplingParams(temperature=0.0, seed=SEED),
                                       json_schema=request.json_schema)
        return _streamed(self._engine, generation)

    def close(self) -> None:
        self.info["pass_ms"] = pass_profile(self.passes)
        self._engine.close()


def pass_profile(passes: Mapping[int, Sequence[float]]) -> Dict[int, Dict[str, float]]:
    """Per pass size (rows): how many passes the trace timed and their median milliseconds (the
    replay's pass costs as this run measured them: ``bench.trace_replay --pass-ms trace.json``).

    >>> pass_profile({4: [0.03, 0.01, 0.02], 1: [0.016]})
    {1: {'passes': 1, 'median_ms': 16.0}, 4: {'passes': 3, 'median_ms': 20.0}}
    """
    return {rows: {"passes": len(seconds), "median_ms": round(1e3 * statistics.median(seconds), 3)}
            for rows, seconds in sorted(passes.items()) if seconds}


def _streamed(engine: Any, generation: GenerationRequest) -> RunResult:
    """One request to the end on a local or remote engine, timed by the bench (:class:`Timeline`)."""
    timeline, texts, tokens, last, emitted = Timeline(), [], [], None, 0
    for step in engine.generate(generation, threading.Event()):
        # a remote step carries no token ids: its count is in the stats
        timeline.output(step.stats.num_generated_tokens - emitted if step.text else 0)
        emitted = step.stats.num_generated_tokens
        texts.append(step.text)
        tokens.extend(step.tokens)
        last = step
    wall, ttft, n_first = timeline.finish()
    stats = last.stats if last is not None else None
    return RunResult(text="".join(texts), n_tokens=stats.num_generated_tokens if stats else 0, wall_s=wall,
                     ttft_s=ttft, n_first=n_first, finish_reason=last.finish_reason if last else "error",
                     tokens=tokens or None, stats=stats_dict(stats) if stats else None,
                     spec_modes=[last.spec_mode] if last else [])


class LlamaServerRunner:
    """One llama-server with one speculative setting for the whole trace, on loopback
    (:class:`~.constrained.LlamaServer`)."""

    def __init__(self, name: str, args: Sequence[str], bin_dir: Path, params: Mapping[str, Any],
                 workdir: Path) -> None:
        target = model_config(params, "target")
        self.name = name
        spec_type, extra = (args[1], list(args[2:])) if args else ("none", [])
        extra += ["-fa", "on" if target.flash_attn else "off"]  # as our engine runs
        self._server = LlamaServer(bin_dir / "llama-server", target.resolved_path, target.n_ctx,
                                   thread_count(params), spec_type, workdir, extra, name.replace("/", "_"))
        self.info = {"command": self._server.argv}
        self._engine = RemoteEngine(RemoteConfig(url=self._server.url, probe_period=0, read_timeout=600.0),
                                    SpecConfig())

    def run(self, request: TraceRequest, max_tokens: int) -> RunResult:
        generation = GenerationRequest(prompt=request.prompt, max_tokens=max_tokens,
                                       sampling=SamplingParams(temperature=0.0, seed=SEED),
                                       json_schema=request.json_schema)
        return _streamed(self._engine, generation)

    def close(self) -> None:
        self._engine.close()
        self._server.stop()


class LookupToolRunner:
    """``llama-lookup`` started for each request, its ``-lcd`` cache one file for the whole trace
    (the bench's native runner; the schema, if any, as ``--json-schema``)."""

    def __init__(self, name: str, k: int, bin_dir: Path, params: Mapping[str, Any], workdir: Path) -> None:
        self.name = name
        self._native = NativeRunner(RunnerSpec(name, "native", "lookup", k), params, str(bin_dir), workdir, 0)
        self.info = self._native.info

    def run(self, request: TraceRequest, max_tokens: int) -> RunResult:
        base = list(self._native._base)
        if request.json_schema:
            self._native._base = base + ["--json-schema", request.json_schema]
        try:
            return self._native.run({"prompt": request.prompt, "max_tokens": max_tokens,
                                     "temperature": 0.0, "seed": SEED})
        finally:
            self._native._base = base

    def close(self) -> None:
        self._native.close()


def make_runners(names: Sequence[str], params: Mapping[str, Any], bin_dir: Optional[Path], workdir: Path,
                 suffix: SuffixConfig) -> List[Any]:
    """The runners named (engine chains, ``llama-lookup/K<k>``, ``llama-server/<setting>``)."""
    settings = dict(NATIVE_NGRAM_SETTINGS)
    runners: List[Any] = []
    for name in names:
        if name.startswith("llama-lookup/K"):
            runners.append(LookupToolRunner(name, int(name.split("/K")[1]), _need(bin_dir), params, workdir))
        elif name.startswith("llama-server/"):
            setting = name.split("/", 1)[1]
            if setting != "none" and setting not in settings:
                raise ValueError(f"{name}: unknown setting; have none, {', '.join(settings)}")
            args = list(settings.get(setting, ()))
            if setting == "ngram-cache":  # the server refuses a dynamic cache file that is not there
                cache = workdir / "llama-server-ngram-cache.lcd"
                cache.write_bytes(b"")
                args += ["-lcd", str(cache)]
            runners.append(LlamaServerRunner(name, args, _need(bin_dir), params, workdir))
        else:
            modes.check_mode_name(name)
            if modes.mode_problem(name, ("lookup", "suffix")):
                raise ValueError(f"runner {name}: a mode of a draft model, not a trace runner")
            runners.append(EngineTraceRunner(name, params, suffix))
    return runners


def _need(bin_dir: Optional[Path]) -> Path:
    if bin_dir is None or not bin_dir.is_dir():
        raise ValueError("llama.cpp's tools are needed: pass --native-bin (scripts/build_native_tools.sh)")
    return bin_dir


def default_runners(bin_dir: Optional[Path]) -> List[str]:
    names = list(ENGINE_MODES)
    if bin_dir is not None and (bin_dir / "llama-lookup").is_file():
        names += [f"llama-lookup/K{k}" for k in LOOKUP_TOOL_KS]
    if bin_dir is not None and (bin_dir / "llama-server").is_file():
        names += [f"llama-server/{s}" for s in SERVER_SETTINGS]
    return names


def run_trace(requests: Sequence[TraceRequest], runners: Sequence[Any], max_tokens: int) -> List[Dict[str, Any]]:
    """Every request to every runner, in order, the runner order rotating; one record each."""
    records = []
    for index, request in enumerate(requests):
        order = list(runners[index % len(runners):]) + list(runners[:index % len(runners)])
        for runner in order:
            spec = RunnerSpec(runner.name, "trace", runner.name)
            load = os.getloadavg()[0]
            result, error = None, ""
            try:
                result = runner.run(request, max_tokens)
            except (RuntimeError, ValueError, OSError) as exc:
                error = str(exc)
            sent = {"temperature": 0.0, "seed": SEED, "max_tokens": max_tokens}
            record = make_record(spec, "trace", request.id, 0, sent, result, error, keep_text=True, load=load)
            record["index"] = index
            records.append(record)
            rate = record.get("tokens_per_s")
            print(f"{request.id} {runner.name:<26} {rate if rate is not None else math.nan:7.1f} tok/s "
                  f"{record.get('n_tokens') or 0:4d} tokens {error[:60]}", file=sys.stderr, flush=True)
    return records


def ratios(records: Sequence[Mapping[str, Any]], runner: str, reference: str) -> List[Tuple[int, float]]:
    """(request index, tokens/s of ``runner`` / ``reference``) for each request both have a rate of."""
    rate = {(r["index"], r["runner"]): r.get("tokens_per_s") for r in records}
    out = []
    for (index, name), value in sorted(rate.items()):
        base = rate.get((index, reference))
        if name == runner and _finite(value) and _finite(base) and base > 0:
            out.append((index, value / base))
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def summarize(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Per runner: median tokens/s, and the median ratios to ``off`` and ``lookup`` over the requests
    after the first :data:`WARM_REQUESTS` (all of them in a shorter trace; every ratio is same-run)."""
    warm = _warm(records)
    out: Dict[str, Dict[str, Any]] = {}
    for name in names:
        rows = [r for r in records if r["runner"] == name and r["index"] >= warm]
        figures: Dict[str, Any] = {"tokens_per_s": _median([r.get("tokens_per_s") for r in rows]),
                                   "tau": _median([r.get("tau") for r in rows]),
                                   "errors": sum(1 for r in records if r["runner"] == name and r.get("error"))}
        for reference in ("off", "lookup"):
            figures[f"vs_{reference}"] = _median([v for i, v in ratios(records, name, reference) if i >= warm])
        out[name] = figures
    return out


def _warm(records: Sequence[Mapping[str, Any]]) -> int:
    """Requests left out of the medians: :data:`WARM_REQUESTS`, or none in a trace that short."""
    return WARM_REQUESTS if len({r["index"] for r in records}) > WARM_REQUESTS else 0


def _median(values: Sequence[Any]) -> float:
    finite = [v for v in values if _finite(v)]
    return statistics.median(finite) if finite else math.nan


def best_native(summary: Mapping[str, Mapping[str, Any]]) -> Optional[str]:
    """The llama.cpp runner (lookup tool or server, not plain decoding) of the highest median ratio
    to ``off``."""
    native = [n for n in summary if n.startswith(("llama-lookup/", "llama-server/"))
              and n != "llama-server/none" and _finite(summary[n]["vs_off"])]
    return max(native, key=lambda n: summary[n]["vs_off"], default=None)


def markdown(results: Mapping[str, Any]) -> str:
    summary, records = results["summary"], results["records"]
    best = results.get("best_native")
    lines = [f"# Trace {results['trace']}{' with the plan schema' if results['constrained'] else ''}", "",
             f"{results['requests']} requests in order, max_tokens {results['max_tokens']}, greedy, "
             f"model {results['model']}; every runner the whole trace, interleaved request by request. "
             f"Medians over the requests after the first {WARM_REQUESTS}; ratios are per request, same run.",
             "", "| runner | tokens/s | vs off | vs lookup | vs best llama.cpp | tau | errors |",
             "|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        versus_best = [v for i, v in ratios(records, name, best) if i >= _warm(records)] if best else []
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {s['vs_off']:.2f}x | {s['vs_lookup']:.2f}x | "
                     f"{statistics.median(versus_best):.2f}x | " if versus_best else
                     f"| {name} | {s['tokens_per_s']:.1f} | {s['vs_off']:.2f}x | {s['vs_lookup']:.2f}x | - | ")
        lines[-1] += f"{s['tau']:.2f} | {s['errors']} |"
    if best:
        lines += ["", f"Best llama.cpp setting on this trace: `{best}`."]
    lines += ["", "Per request, tokens/s:", "", "| request | " + " | ".join(summary) + " |",
              "|---|" + "---|" * len(summary)]
    by_key = {(r["index"], r["runner"]): r for r in records}
    for index in sorted({r["index"] for r in records}):
        cells = [by_key.get((index, name), {}).get("tokens_per_s") for name in summary]
        request_id = next(r["prompt_id"] for r in records if r["index"] == index)
        lines.append(f"| {request_id} | " + " | ".join(f"{c:.1f}" if _finite(c) else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=TRACES, default="planner")
    parser.add_argument("--constrained", action="store_true", help="every request with the plan schema")
    parser.add_argument("--config", default="", help="node params file (default: the embedded config)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=0, help="only the first N requests (0 = all)")
    parser.add_argument("--runners", default="", help="comma-separated (default: the engine chains, "
                        "llama-lookup/K3,K8 and the llama-server settings where --native-bin has them)")
    parser.add_argument("--native-bin", default=os.path.expanduser("~/.cache/gemma_spec_ros/native/bin"))
    parser.add_argument("--out", default="bench_trace")
    args = parser.parse_args(argv)
    params = load_params(args.config) if args.config else default_params()
    requests = trace_requests(args.trace, args.constrained)[:args.requests or None]
    bin_dir = Path(expand_path(args.native_bin)) if args.native_bin else None
    names = [n.strip() for n in args.runners.split(",") if n.strip()] or default_runners(bin_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "work"  # the llama.cpp tools' caches and logs: a trace starts with none
    workdir.mkdir(exist_ok=True)
    for stale in workdir.glob("*.lcd"):
        stale.unlink()
    runners: List[Any] = []
    try:
        runners = make_runners(names, params, bin_dir, workdir, SuffixConfig())
        records = run_trace(requests, runners, args.max_tokens)
    finally:
        for runner in runners:
            runner.close()
    summary = summarize(records, names)
    results = {"trace": args.trace, "constrained": args.constrained, "requests": len(requests),
               "max_tokens": args.max_tokens, "model": Path(model_config(params, "target").resolved_path).name,
               "command": "python -m gemma_spec_dev.bench.trace " + " ".join(sys.argv[1:] if argv is None else argv),
               "loadavg_end": [round(x, 2) for x in os.getloadavg()],
               "runners": {r.name: r.info for r in runners}, "summary": summary,
               "best_native": best_native(summary), "records": records}
    (out / "trace.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "trace.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
