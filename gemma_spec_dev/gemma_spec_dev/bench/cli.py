"""``gemma-spec-bench``: prompt suites x speculative modes (x K), against same-run baselines.

Every runner (an engine mode with a fixed or adaptive K, llama-cpp-python's plain and prompt-lookup
generation, llama.cpp's native tools, the Generate action of a running node) runs in its own process,
so its peak RSS is its own, and the runs are interleaved: for each repeat, for each prompt, each runner
in turn (the order rotating), so machine noise hits all of them alike. Workers restart at each repeat:
the engine's dynamic n-gram cache learns across the prompts of a repeat but never sees a prompt's own
earlier output. Speedups are same-run ratios against ``off`` (see bench.metrics). Nothing is
downloaded: models come from the params file or --target/--draft.

Writes into --out: results.json, results.md (tables), results_per_prompt.md, four PNG plots and
workers.log (the workers' stderr).

Examples::

    gemma-spec-bench --suites all --modes all --repeats 3             # the full run (embedded config)
    gemma-spec-bench --smoke --out /tmp/bench                          # seconds; what the tests run
    gemma-spec-bench --suites code,structured --modes lookup --k 1,2,3,4,8 --baselines none
    gemma-spec-bench --target ~/.cache/gemma_spec_ros/models/gemma-3-270m-f16.gguf \\
        --draft ~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf --modes all
    gemma-spec-bench --temperature 0.7 --seed 7                        # a seeded sampled run
    gemma-spec-bench --suites none --random-prompts 12 --seed 99       # prompts drawn at run time
    gemma-spec-bench --native-bin ~/.cache/gemma_spec_ros/native/bin   # + llama-lookup et al.
    gemma-spec-bench --modes lookup --native-bin ~/.cache/gemma_spec_ros/native/bin --native-sweep
                                                                       # + ours vs the best native setting
    gemma-spec-bench --via-action gemma_spec                           # + through a running node
    gemma-spec-bench --via-remote http://127.0.0.1:8080                # + from an inference server
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, IO, List, Mapping, Optional, Sequence, Tuple

from gemma_spec_ros.engine.drafters.registry import model_kind
from gemma_spec_ros.engine.config import expand_path
from gemma_spec_ros.engine.modes import SPEC_MODES
from .config import (Prompt, RunnerSpec, Suite, apply_overrides,
                     default_params, find_data_dir, load_params, load_suites, model_config, parse_baselines, parse_ks,
                     PROMPT_REUSE_CHOICES, parse_modes, parse_native_sweep, plan_runners, select_suites, thread_count)
from .corpus import default_corpus, random_suite
from .machine import llama_build, machine_info
from .native import NativeRunner
# native_decode_rate: not used here, but part of the command's face (bench.native_decode_rate)
from .record import make_record, make_request, native_decode_rate  # noqa: F401
from .remote import RemoteRunner, remote_runners
from .report import add_speedups, dump_results, markdown, markdown_per_prompt, plot_all, summarize
from .runner import MeasuredRunner, Request
from .worker_handle import RunnerError, WorkerHandle

SCHEMA_VERSION = 1
#: A short generation run once by each worker before it is measured (thread pools, page faults).
WARMUP_REQUEST_TOKENS = 4
WARMUP_PROMPT = "The quick brown fox"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemma-spec-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="", help="node params file (/**: ros__parameters:); "
                   "default: the installed config/embedded.yaml, else the embedded model")
    p.add_argument("--target", default="", help="target model path (overrides target.model_path)")
    p.add_argument("--draft", default="", help="draft model path (overrides draft.model_path; 'none' drops it)")
    p.add_argument("--suites", default="all", help="comma-separated suite names, all, or none (with "
                   "--random-prompts: only the random suite)")
    p.add_argument("--prompts-per-suite", type=int, default=0, metavar="N",
                   help="only the first N prompts of each suite (0 = all)")
    p.add_argument("--random-prompts", type=int, default=0, metavar="N",
                   help="add a suite 'random' of N prompt beginnings drawn at run time from --corpus "
                        "with --seed (bench.corpus): prompts nobody tuned for")
    p.add_argument("--corpus", action="append", default=[], metavar="DIR",
                   help="folder of text files for --random-prompts (repeatable; default: this "
                        "interpreter's standard library and installed packages)")
    p.add_argument("--prompts-dir", default="", help="folder of suite files (default: the package's prompts/)")
    p.add_argument("--modes", default="all", help=f"comma-separated of {','.join(SPEC_MODES)}, "
                   "or all (off always runs: it is the reference)")
    p.add_argument("--prompt-reuse", choices=PROMPT_REUSE_CHOICES, default="on",
                   help="engine runners reuse the previous request's prompt prefix (on, the node's "
                        "default), evaluate every prompt whole (off), or both side by side (a "
                        "<name>/no-reuse twin of each; the 'Prompt reuse' table compares them)")
    p.add_argument("--k", default="adaptive", help="draft lengths: e.g. 2,3,4,8,adaptive (adaptive = the "
                   "configured K with the policy)")
    p.add_argument("--adaptive-k", default="", metavar="K,...",
                   help="more adaptive runners, each with the policy capped at that K instead of the "
                        "configured spec.draft_max (named e.g. lookup/A8)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every (prompt, runner)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=1234, help="sampler seed of every request")
    p.add_argument("--baselines", default="on", help="llama-cpp-python baselines: on, none, or "
                   "plain,prompt-lookup")
    p.add_argument("--native-bin", default="", help="folder with llama-lookup / llama-speculative-simple "
                   "(scripts/build_native_tools.sh)")
    p.add_argument("--native-k", default="3", help="draft lengths of the native tools (default 3)")
    p.add_argument("--native-sweep", nargs="?", const="all", default="", metavar="SETTINGS",
                   help="with --native-bin: every n-gram setting of llama.cpp's tools (llama-lookup at "
                        "K 3, 5, 8 and --native-k; llama-speculative-simple's ngram-cache, ngram-simple, "
                        "ngram-map-k, ngram-mod with their defaults and short n-grams) and a table of "
                        "ours against the best of them per prompt (the native oracle); optionally only "
                        "the llama-speculative-simple settings named (e.g. ngram-cache,ngram-mod/n4)")
    p.add_argument("--via-action", default="", metavar="NODE",
                   help="also send the requests to /NODE/generate of a running node (e.g. gemma_spec)")
    p.add_argument("--via-remote", default="", metavar="URL",
                   help="also stream the requests from the OpenAI-compatible server at URL (llama-server, "
                   "vLLM, llama_cpp.server), as the node's remote backend does (runner 'remote')")
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run: first prompt of the first 2 suites, 16 tokens, 1 repeat")
    p.add_argument("--omp-wait-policy", default="inherit", choices=("passive", "active", "inherit"),
                   help="OMP_WAIT_POLICY of every runner (llama.cpp's CPU threads are OpenMP): inherit "
                   "(default) leaves the environment as it is, as the node runs; passive keeps a busy "
                   "machine from stalling spinning threads but puts a sleep and a wake-up behind every "
                   "barrier of a decode (measured: a one-token decode of the embedded model 28 -> 52 ms "
                   "in the engine, less in llama.cpp's own tools, so it skews that comparison)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a worker may take to start")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report-only", default="", metavar="DIR",
                   help="re-write tables and plots from DIR/results.json, run nothing")
    return p


class Bench:
    """One bench invocation: plans runners, runs the interleaved schedule, writes the outputs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        params = load_params(args.config) if args.config else default_params()
        self.params: Dict[str, Any] = apply_overrides(params, expand_path(args.target), args.draft)
        for role in ("target", "draft"):  # the node's validation, and the files, before any worker starts
            model = model_config(self.params, role)
            if model is not None and not os.path.isfile(model.resolved_path):
                raise ValueError(f"{role} model not found: {model.resolved_path} (`make setup` assembles "
                                 "the embedded model; --target/--draft override the config)")
        prompts_dir = Path(expand_path(args.prompts_dir)) if args.prompts_dir else find_data_dir("prompts")
        if prompts_dir is None:
            raise ValueError("prompt suites not found: pass --prompts-dir")
        suites = select_suites(load_suites(prompts_dir), args.suites)
        if args.prompts_per_suite > 0:
            suites = [Suite(s.name, s.description, s.order, s.prompts[:args.prompts_per_suite]) for s in suites]
        if args.random_prompts:
            roots = [Path(expand_path(c)) for c in args.corpus] or default_corpus()
            missing = [str(r) for r in roots if not r.is_dir()]
            if missing:
                raise ValueError(f"--corpus: not a folder: {', '.join(missing)}")
            suites.append(random_suite(args.random_prompts, roots, args.seed, exclude=[prompts_dir]))
        if not suites:
            raise ValueError("no prompts: --suites none needs --random-prompts N")
        if args.smoke:
            suites = [Suite(s.name, s.description, s.order, s.prompts[:1]) for s in suites[:2]]
            args.max_tokens, args.repeats = 16, 1
        if args.repeats < 1 or args.max_tokens < 1:
            raise ValueError("--repeats and --max-tokens must be >= 1")
        self.suites = suites
        draft = model_config(self.params, "draft")
        has_draft = draft is not None
        native_ks = [k for k in parse_ks(args.native_k) if k is not None]
        self.specs, self.notes = plan_runners(parse_modes(args.modes), parse_ks(args.k), has_draft,
                                              parse_baselines(args.baselines), args.native_bin, native_ks,
                                              args.via_action, args.prompt_reuse,
                                              model_kind=model_kind(draft.resolved_path).name if has_draft
                                              else "draft",
                                              native_sweep=parse_native_sweep(args.native_sweep),
                                              adaptive_ks=[k for k in parse_ks(args.adaptive_k or "adaptive")
                                                           if k is not None])
        self.specs += remote_runners(args.via_remote, parse_baselines(args.baselines))
        self.out_dir = Path(expand_path(args.out))
        if args.omp_wait_policy != "inherit":  # every worker and native tool inherits it
            os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
        self.runner_info: Dict[str, Dict[str, Any]] = {
            s.name: {**asdict(s), "k": s.k_label, "peak_rss_mb": None, "base_rss_mb": None, "info": None}
            for s in self.specs}

    # -- schedule ---------------------------------------------------------------------------------
    def start(self, spec: RunnerSpec, repeat: int, log: IO[bytes]) -> MeasuredRunner:
        if spec.kind == "native":
            return NativeRunner(spec, self.params, self.args.native_bin, self.out_dir, repeat)
        if spec.kind == "remote":
            runner = RemoteRunner(spec, self.args.via_remote, self.params)
            runner.run(make_request(WARMUP_PROMPT, WARMUP_REQUEST_TOKENS, self.args.temperature,
                                    self.args.seed))
            return runner
        handle = WorkerHandle(spec, self.params, self.args.via_action, log, self.args.timeout)
        handle.run(make_request(WARMUP_PROMPT, WARMUP_REQUEST_TOKENS, self.args.temperature, self.args.seed))
        return handle

    def run(self) -> Dict[str, Any]:
        """The interleaved schedule. Interrupted (Ctrl-C, SIGTERM), it keeps the runs done so far."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        machine = machine_info()
        prompts = [p for s in self.suites for p in s.prompts]
        records: List[Dict[str, Any]] = []
        started = time.perf_counter()
        total = self.args.repeats * len(prompts) * len(self.specs)
        progress = _progress(total, self.args.no_progress)
        handles: Dict[str, MeasuredRunner] = {}
        try:
            with open(self.out_dir / "workers.log", "wb") as log:
                for repeat in range(self.args.repeats):
                    handles, failed = self._start_all(repeat, log, progress)
                    for index, prompt in enumerate(prompts):
                        request = make_request(prompt.text, self.args.max_tokens, self.args.temperature,
                                               self.args.seed)
                        for spec in _rotate(self.specs, index + repeat):
                            progress.set_postfix_str(f"r{repeat} {prompt.suite}/{prompt.id} {spec.name}",
                                                     refresh=False)
                            records.append(self._run_one(spec, prompt, repeat, request, handles, failed))
                            progress.update()
                    self._close_all(handles)
                    handles = {}
        except KeyboardInterrupt:
            self.notes.append(f"interrupted after {len(records)} of {total} runs: partial results")
            self._close_all(handles)
        progress.close()
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        return self._results(machine, records, time.perf_counter() - started)

    def _run_one(self, spec: RunnerSpec, prompt: Prompt, repeat: int, request: Request,
                 handles: Mapping[str, MeasuredRunner], failed: Mapping[str, str]) -> Dict[str, Any]:
        result, error = None, failed.get(spec.name, "")
        load = os.getloadavg()[0]
        if not error:
            try:
                result = handles[spec.name].run(request)
            except (RunnerError, RuntimeError, ValueError) as exc:
                error = str(exc)
        # Every runner's text of the first repeat: the oracle table says whose text is off's
        # (report.summary.same_text_as_off); the other repeats' parity is in output_hash.
        keep = repeat == 0
        return make_record(spec, prompt.suite, prompt.id, repeat, request, result, error,
                           keep_text=keep, load=load)

    def _start_all(self, repeat: int, log: IO[bytes],
                   progress: Any) -> Tuple[Dict[str, MeasuredRunner], Dict[str, str]]:
        handles: Dict[str, MeasuredRunner] = {}
        failed: Dict[str, str] = {}
        for spec in self.specs:
            progress.set_postfix_str(f"r{repeat} starting {spec.name}", refresh=True)
            try:
                handles[spec.name] = self.start(spec, repeat, log)
                self.runner_info[spec.name]["info"] = handles[spec.name].info
            except (RunnerError, RuntimeError, ValueError, OSError) as exc:
                failed[spec.name] = f"start failed: {exc}"
                note = f"runner {spec.name} failed to start: {exc}"
                if note not in self.notes:
                    self.notes.append(note)
        return handles, failed

    def _close_all(self, handles: Mapping[str, MeasuredRunner]) -> None:
        for name, handle in handles.items():
            handle.close()
            info = self.runner_info[name]
            info["peak_rss_mb"] = max(info["peak_rss_mb"] or 0.0, handle.peak_rss_mb) or None
            if handle.base_rss_mb is not None:
                info["base_rss_mb"] = handle.base_rss_mb

    def _results(self, machine: Dict[str, Any], records: List[Dict[str, Any]], elapsed: float) -> Dict[str, Any]:
        target = model_config(self.params, "target")
        draft = model_config(self.params, "draft")
        config = {
            "target": target.resolved_path if target else None,
            "target_size_bytes": _size(target.resolved_path if target else ""),
            "draft": draft.resolved_path if draft else None,
            "draft_size_bytes": _size(draft.resolved_path if draft else ""),
            "params": self.params, "threads": thread_count(self.params),
            "suites": [s.name for s in self.suites], "prompts_per_suite": {s.name: len(s.prompts) for s in self.suites},
            "modes": self.args.modes, "k": self.args.k, "adaptive_k": self.args.adaptive_k,
            "repeats": self.args.repeats,
            "max_tokens": self.args.max_tokens, "temperature": self.args.temperature, "seed": self.args.seed,
            "baselines": self.args.baselines, "native_bin": self.args.native_bin or None,
            "native_sweep": self.args.native_sweep or None,
            "via_action": self.args.via_action or None, "via_remote": self.args.via_remote or None,
            "smoke": self.args.smoke,
            "random_prompts": self.args.random_prompts,
            "corpus": [str(r) for r in ([Path(expand_path(c)) for c in self.args.corpus] or default_corpus())]
            if self.args.random_prompts else None,
            "prompt_ids": {s.name: [p.id for p in s.prompts] for s in self.suites},
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "flash_attn": bool(target.flash_attn) if target else None,
            "llama_build": llama_build(),
            "command": "gemma-spec-bench " + " ".join(sys.argv[1:]) if sys.argv else "",
        }
        runners = list(self.runner_info.values())
        return {
            "schema_version": SCHEMA_VERSION,
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "elapsed_s": round(elapsed, 1), "machine": machine, "config": config,
            "rss_method": "each runner in its own process: peak RSS = that process's VmHWM (the "
                          "llama.cpp native tools: the child's rusage from wait4); base = the worker with "
                          "llama_cpp imported, before loading any model; workers restart at each repeat "
                          "and the maximum is reported",
            "speed_method": "tokens/s = (tokens - tokens of the first output) / (wall - TTFT), measured by "
                            "the bench around each request (native tools: their printed decode time, and "
                            "llama-lookup's tokens less the first, which its prompt pass gave); "
                            "speedup = tokens/s / off's tokens/s on the same prompt in the same repeat",
            "notes": self.notes, "runners": runners, "summary": {}, "runs": records,
        }


def finalize(results: Dict[str, Any]) -> Dict[str, Any]:
    """(Re)compute every derived figure of ``results`` from its runs and runners: each run's
    speedups and the summary. --report-only calls it too, so a stored run gets the current report."""
    runners = results["runners"]
    add_speedups(results["runs"], {r["name"]: r.get("reference", "") for r in runners})
    results["summary"] = summarize(results["runs"], runners, list(results["config"]["suites"]))
    return results


def _size(path: str) -> Optional[int]:
    return os.path.getsize(path) if path and os.path.isfile(path) else None


def _rotate(specs: Sequence[RunnerSpec], shift: int) -> List[RunnerSpec]:
    """The runner order for one prompt: rotated so no runner always runs right after another."""
    shift %= max(1, len(specs))
    return list(specs[shift:]) + list(specs[:shift])


class _NoProgress:
    def update(self, n: int = 1) -> None:
        """Nothing to draw."""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        """Nothing to draw."""

    def close(self) -> None:
        """Nothing to draw."""


def _progress(total: int, disabled: bool) -> Any:
    if disabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)


def write_outputs(results: Dict[str, Any], out_dir: Path) -> List[Path]:
    """Finalize ``results``, then write results.json, results.md, results_per_prompt.md and the
    plots; returns the paths written.

    The derived figures are computed from the runs as results.json stores them (rounded), so
    --report-only, which can only read the rounded runs, re-makes the very same tables (a ratio
    computed from unrounded rates can land on the other side of a table's rounding)."""
    results = finalize(json.loads(dump_results(results)))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "results_per_prompt.md"]
    paths[0].write_text(dump_results(results), encoding="utf-8")
    strict = json.loads(paths[0].read_text(encoding="utf-8"))  # the plots read what was written
    paths[1].write_text(markdown(strict), encoding="utf-8")
    paths[2].write_text(markdown_per_prompt(strict), encoding="utf-8")
    return paths + plot_all(strict, out_dir)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``gemma-spec-bench``; returns the exit status."""
    args = build_parser().parse_args(argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)  # a timeout still writes partial results
    try:
        return _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    try:
        if args.report_only:
            out_dir = Path(expand_path(args.report_only))
            results = json.loads((out_dir / "results.json").read_text(encoding="utf-8"))
        else:
            bench = Bench(args)
            for note in bench.notes:
                print(f"note: {note}", file=sys.stderr)
            print(f"runners: {', '.join(s.name for s in bench.specs)}; "
                  f"{sum(len(s.prompts) for s in bench.suites)} prompts x {args.repeats} repeat(s)",
                  file=sys.stderr)
            results = bench.run()
            out_dir = bench.out_dir
        paths = write_outputs(results, out_dir)
    except (ValueError, OSError) as exc:
        print(f"gemma-spec-bench: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(json.loads(paths[0].read_text(encoding="utf-8"))))
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    failed = [r for r in results["runs"] if r.get("error")]
    return 1 if failed and len(failed) == len(results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
