"""Constrained output, measured: the planner suite's prompts with its plan schema, same run.

    python -m gemma_spec_dev.bench.constrained --out docs/bench/cpu_constrained

Runners, interleaved prompt by prompt (each prompt: every runner once, in a rotating order):

- ``off``, ``lookup``, ``auto``: our engine (one instance, the embedded model, the node's defaults
  of config/embedded.yaml: adaptive K, prompt reuse), every request with the suite's json_schema;
- ``off/free``, ``lookup/free``: the same without the schema (what the constraint costs or gains);
- ``llama-server/<spec-type>``: llama.cpp's own server on the same model with the same
  ``json_schema`` in each of its speculative settings (none, and each n-gram spec type with its
  defaults), started here on loopback; the best of them is the one to beat.

Reported per runner: the share of outputs that parse as JSON and validate against the schema
(``jsonschema``), decode tokens/s (tokens after the first / time after the first, the same
definition for every runner), tau, and the tokens our grammar drafted and had accepted. Writes
``constrained.json``, ``constrained.md`` (tables) and ``constrained.png`` (tokens/s per runner).
Speed figures are same-run ratios: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.config import EngineConfig, LookupConfig, ModelConfig, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from .config import find_data_dir, load_suite

#: llama-server's speculative settings tried (``--spec-type``; defaults of each type).
SERVER_SETTINGS = ("none", "ngram-cache", "ngram-simple", "ngram-map-k", "ngram-mod")
#: (mode, variant): ``json`` = with the schema; ``free`` = without it
ENGINE_RUNNERS = (("off", "json"), ("lookup", "json"), ("auto", "json"), ("off", "free"),
                  ("lookup", "free"))


def validate(text: str, schema: Mapping[str, Any]) -> str:
    """'' if ``text`` parses as JSON and follows ``schema``, else why not."""
    import jsonschema  # noqa: WPS433  (a bench dependency, installed by scripts/setup.sh)

    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """llama-server on loopback with one speculative setting; ``stop()`` ends it."""

    def __init__(self, exe: Path, model: str, n_ctx: int, threads: int, spec_type: str, log_dir: Path,
                 extra_args: Sequence[str] = (), name: str = "") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(exe), "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(n_ctx),
                "-t", str(threads), "-np", "1", "--metrics"]
        if spec_type != "none":
            argv += ["--spec-type", spec_type]
        argv += list(extra_args)  # the type's sizes, a dynamic cache, flash attention
        self.argv = argv
        self._log = open(log_dir / f"llama-server-{name or spec_type}.log", "wb")
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server --spec-type {spec_type} exited; see {self._log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama-server --spec-type {spec_type} did not become ready")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


def run_one(engine: Any, request: GenerationRequest, schema: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    text, last = "", None
    for step in engine.generate(request):
        text += step.text
        last = step
    stats = last.stats
    return {"text": text, "finish_reason": last.finish_reason,
            "tokens": stats.num_generated_tokens, "tokens_per_s": stats.tokens_per_second,
            "tau": stats.mean_acceptance_length,
            "grammar_drafted": stats.num_grammar_draft_tokens,
            "grammar_accepted": stats.num_grammar_accepted_tokens,
            "grammar_masks": stats.num_grammar_masks, "grammar_ms": stats.grammar_time * 1e3,
            "problem": validate(text, schema) if schema is not None else ""}


def by_runner(records: Sequence[Mapping[str, Any]]) -> Dict[str, List[Mapping[str, Any]]]:
    """The records of each runner, runners in the order they first appear."""
    grouped: Dict[str, List[Mapping[str, Any]]] = {}
    for record in records:
        grouped.setdefault(record["runner"], []).append(record)
    return grouped


def summarize(records: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    out = {}
    for runner, rows in by_runner(records).items():
        rates = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] and not math.isnan(r["tokens_per_s"])]
        taus = [r["tau"] for r in rows if not math.isnan(r["tau"])]
        constrained = rows[0]["constrained"]
        out[runner] = {
            "requests": len(rows), "constrained": constrained,
            "valid_share": (sum(not r["problem"] for r in rows) / len(rows)) if constrained else math.nan,
            "tokens_per_s_median": statistics.median(rates) if rates else math.nan,
            "tau_median": statistics.median(taus) if taus else math.nan,
            "tokens_mean": statistics.mean(r["tokens"] for r in rows),
            "grammar_accepted_share": (sum(r["grammar_accepted"] for r in rows)
                                       / max(1, sum(r["tokens"] for r in rows))),
            "grammar_masks": sum(r["grammar_masks"] for r in rows),
        }
    return out


def ratios(records: Sequence[Mapping[str, Any]], runner: str, reference: str) -> List[float]:
    """Per-prompt tokens/s ratios runner / reference (same prompt, same repeat)."""
    rate = {(r["prompt"], r["repeat"], r["runner"]): r["tokens_per_s"] for r in records}
    out = []
    for (prompt, repeat, name), value in rate.items():
        if name == runner and (prompt, repeat, reference) in rate and rate[(prompt, repeat, reference)]:
            out.append(value / rate[(prompt, repeat, reference)])
    return out


def markdown(results: Mapping[str, Any]) -> str:
    summary = results["summary"]
    lines = [f"# Constrained output: {results['suite']} suite, json_schema {results['schema']}", "",
             f"{results['prompts']} prompts x {results['repeats']} repeats, max_tokens {results['max_tokens']}, "
             f"greedy, model {results['model']}; same run, interleaved. Tokens/s: decode rate after the "
             "first token.", "",
             "| runner | valid JSON (schema) | tokens/s (median) | vs constrained off (median) | tau | "
             "tokens (mean) | grammar-drafted share of output | rows masked |",
             "|---|---|---|---|---|---|---|---|"]
    for runner, s in summary.items():
        vs = ratios(results["records"], runner, "off")
        valid = "-" if not s["constrained"] else f"{100 * s['valid_share']:.0f}%"
        lines.append(f"| {runner} | {valid} | {s['tokens_per_s_median']:.1f} | "
                     f"{statistics.median(vs):.2f}x | {s['tau_median']:.2f} | {s['tokens_mean']:.0f} | "
                     f"{100 * s['grammar_accepted_share']:.0f}% | {s['grammar_masks']} |"
                     if vs else f"| {runner} | {valid} | {s['tokens_per_s_median']:.1f} | - | "
                     f"{s['tau_median']:.2f} | {s['tokens_mean']:.0f} | - | - |")
    paired = [(name, ratios(results["records"], name, f"{name}/free")) for name in ("off", "lookup")]
    if any(vs for _, vs in paired):
        lines += ["", "With the schema / without it, same prompt (median): " + ", ".join(
            f"{name} {statistics.median(vs):.2f}x" for name, vs in paired if vs)]
    best = results.get("best_server")
    if best:
        lines += ["", f"Best llama-server setting: `{best}`. Ours / it, per prompt (median): " + ", ".join(
            f"{name} {statistics.median(ratios(results['records'], name, best)):.2f}x"
            for name in ("off", "lookup", "auto") if ratios(results["records"], name, best))]
    bad = [r for r in results["records"] if r["problem"]]
    if bad:
        lines += ["", "Outputs that did not validate:"] + [
            f"- {r['runner']} {r['prompt']}: {r['problem'][:120]}" for r in bad]
    return "\n".join(lines) + "\n"


def plot(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib  # noqa: WPS433

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: WPS433

    names = list(results["summary"])
    rates = [results["summary"][n]["tokens_per_s_median"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(names)), rates, color=["C0" if results["summary"][n]["constrained"] else "C7" for n in names])
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s (median, decode)")
    ax.set_title(f"{results['suite']} suite with its plan schema (grey: unconstrained)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--suite", default="planner")
    p.add_argument("--prompts-dir", default="", help="folder of suite files (default: the package's prompts/)")
    p.add_argument("--schema", default="", help="JSON Schema file (default: the suite's json_schema_file)")
    p.add_argument("--prompts", type=int, default=0, help="first N prompts (0 = all)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--native-bin", default=os.path.expanduser("~/.cache/gemma_spec_ros/native/bin"))
    p.add_argument("--server-settings", default=",".join(SERVER_SETTINGS),
                   help="llama-server --spec-type values to run ('' = none)")
    p.add_argument("--out", default="bench_constrained")
    args = p.parse_args(argv)

    prompts_dir = Path(args.prompts_dir) if args.prompts_dir else find_data_dir("prompts")
    suite = load_suite(prompts_dir / f"{args.suite}.yaml")
    schema_path = Path(args.schema) if args.schema else suite.json_schema_path
    if schema_path is None:
        p.error(f"suite {args.suite} declares no json_schema_file: give --schema")
    schema_text = schema_path.read_text()
    schema = json.loads(schema_text)
    prompts = suite.prompts[:args.prompts or None]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    engine = Engine(EngineConfig(target=ModelConfig(args.model, n_ctx=args.n_ctx, n_threads=args.threads),
                                 lookup=LookupConfig(), spec=SpecConfig(mode="off", draft_max=4)))
    servers: Dict[str, LlamaServer] = {}
    remotes: Dict[str, RemoteEngine] = {}
    try:
        for setting in filter(None, args.server_settings.split(",")):
            servers[setting] = LlamaServer(Path(args.native_bin) / "llama-server", args.model, args.n_ctx,
                                           args.threads, setting, out)
            remotes[f"llama-server/{setting}"] = RemoteEngine(
                RemoteConfig(url=servers[setting].url, probe_period=0), SpecConfig())
        runners: List[str] = [m if v == "json" else f"{m}/{v}" for m, v in ENGINE_RUNNERS] + list(remotes)
        records: List[Dict[str, Any]] = []
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                order = runners[i % len(runners):] + runners[:i % len(runners)]
                for runner in order:
                    constrained = not runner.endswith("/free")
                    mode = runner.split("/")[0]
                    request = GenerationRequest(
                        prompt.text, max_tokens=args.max_tokens, json_schema=schema_text if constrained else "",
                        spec_mode=None if runner in remotes else mode)
                    target = remotes.get(runner, engine)
                    record = run_one(target, request, schema if constrained else None)
                    record.update(runner=runner, prompt=prompt.id, repeat=repeat, constrained=constrained)
                    records.append(record)
                    print(f"{prompt.id:>14} {runner:<26} {record['tokens_per_s']:7.1f} tok/s "
                          f"{record['tokens']:4d} tokens {record['problem'][:60]}", file=sys.stderr)
    finally:
        engine.close()
        for server in servers.values():
            server.stop()
    summary = summarize(records)
    server_names = [n for n in summary if n.startswith("llama-server/")]
    best = max(server_names, key=lambda n: summary[n]["tokens_per_s_median"], default=None)
    results = {"suite": suite.name, "schema": str(schema_path.name), "prompts": len(prompts),
               "repeats": args.repeats, "max_tokens": args.max_tokens, "model": Path(args.model).name,
               "summary": summary, "best_server": best, "records": records}
    (out / "constrained.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "constrained.md").write_text(markdown(results))
    plot(results, out / "constrained.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
