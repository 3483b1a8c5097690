"""Several clients at once, timed: the same goals served together, one at a time, and by llama-server.

    python -m gemma_spec_dev.bench.clients --clients 1,2,3,4 --modes off,lookup --out bench_clients

N clients (threads) start together; each sends its goals one after the other, greedy, each waiting
for its goal's result before sending the next (a planner, a dialogue node, a monitor). The goals are
the planner trace's requests (:mod:`.trace_requests`), client i taking every N-th. Runners, each on
the same goals, in rotating order, a fresh engine or server per run (what one run learns, another
does not inherit):

- ``together/<mode>``: our engine with ``max_running`` N: the running goals' steps share one target
  pass (engine/slots.py);
- ``one-at-a-time/<mode>``: our engine with ``max_running`` 1: the same N clients, the goals served
  one after another (what the node did before slots);
- ``llama-server/<setting>``: ``llama-server -np N`` with a speculative setting of llama.cpp's (plain,
  or an n-gram type), the N clients sending ``/completion`` requests at once.

Figures per run: total tokens/s (every goal's generated tokens over the run's wall time: first send
to last result) and per-goal latency (send to result; median and 90th percentile); per client count
the ratios ``together / one-at-a-time`` and ``together / best llama-server``. Writes
``clients.json``, ``clients.md`` and ``clients.png`` into ``--out``. The machine may be shared: the
ratios are same-run ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from gemma_spec_ros.engine.config import SamplingParams
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.request import GenerationRequest
from .config import NATIVE_NGRAM_SETTINGS, default_params, engine_config, load_params, model_config, thread_count
from .constrained import LlamaServer
from .machine import machine_info
from .trace_requests import TraceRequest, trace_requests

#: llama-server settings by default: plain decoding and llama.cpp's n-gram types.
SERVER_SETTINGS: Tuple[str, ...] = ("none", "ngram-simple/n3m8", "ngram-map-k/n3m8", "ngram-mod/n4",
                                    "ngram-cache")
SEED = 1234


@dataclasses.dataclass
class Goal:
    """One goal of one client: what it sent, what came back, when."""

    client: int
    id: str
    sent: float = 0.0
    done: float = 0.0
    tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def latency(self) -> float:
        return self.done - self.sent


def run_clients(serve: Callable[[TraceRequest, int], Tuple[int, str]], goals: Sequence[Sequence[TraceRequest]],
                max_tokens: int) -> Tuple[List[Goal], float]:
    """Each client's goals in a thread of its own, all clients started together; ``serve(goal,
    max_tokens)`` returns (generated tokens, text). Returns every goal and the run's wall time."""
    done: List[Goal] = []
    lock = threading.Lock()
    start = threading.Barrier(len(goals) + 1)

    def client(index: int, requests: Sequence[TraceRequest]) -> None:
        start.wait()
        for request in requests:
            goal = Goal(index, request.id, sent=time.perf_counter())
            try:
                goal.tokens, goal.text = serve(request, max_tokens)
            except Exception as exc:  # noqa: BLE001  recorded: a failed goal must show
                goal.error = repr(exc)
            goal.done = time.perf_counter()
            with lock:
                done.append(goal)
    threads = [threading.Thread(target=client, args=(i, g)) for i, g in enumerate(goals)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return done, time.perf_counter() - began


def engine_server(params: Mapping[str, Any], mode: str, max_running: int) -> Tuple[Engine, Callable]:
    """A fresh engine (calibrated as the node's) serving ``mode`` with ``max_running`` slots."""
    config = dataclasses.replace(engine_config(params, mode, None), max_running=max_running)
    engine = Engine(config)

    def serve(request: TraceRequest, max_tokens: int) -> Tuple[int, str]:
        generation = GenerationRequest(prompt=request.prompt, max_tokens=max_tokens, spec_mode=mode,
                                       sampling=SamplingParams(temperature=0.0, seed=SEED),
                                       json_schema=request.json_schema)
        last, text = None, []
        for step in engine.generate(generation):
            text.append(step.text)
            last = step
        return last.stats.num_generated_tokens, "".join(text)
    return engine, serve


def kv_bytes_per_token(engine: Engine) -> float:
    """KV cache bytes one token of a sequence holds (llama.cpp's state of sequence 0, over its
    length): a slot reserves ``n_ctx`` times this."""
    import llama_cpp  # noqa: WPS433

    target = engine.target
    _, ctx = target.handles
    n = target.past(0)
    return float(llama_cpp.llama_state_seq_get_size(ctx, 0)) / n if n else float("nan")


def llama_server(params: Mapping[str, Any], setting: str, n_parallel: int, bin_dir: Path,
                 workdir: Path) -> Tuple[LlamaServer, Callable]:
    """llama-server with ``-np n_parallel`` and one speculative setting of llama.cpp's."""
    target = model_config(params, "target")
    args = dict(NATIVE_NGRAM_SETTINGS)[setting] if setting != "none" else ()
    spec_type, extra = (args[1], list(args[2:])) if args else ("none", [])
    extra += ["-fa", "on" if target.flash_attn else "off", "-np", str(n_parallel)]
    # each slot keeps the whole context, as each of our slots does
    server = LlamaServer(bin_dir / "llama-server", target.resolved_path, target.n_ctx * n_parallel,
                         thread_count(params), spec_type, workdir, extra,
                         f"{setting.replace('/', '_')}-np{n_parallel}")

    def serve(request: TraceRequest, max_tokens: int) -> Tuple[int, str]:
        body: Dict[str, Any] = {"prompt": request.prompt, "n_predict": max_tokens, "temperature": 0.0,
                                "seed": SEED, "cache_prompt": True}
        if request.json_schema:
            body["json_schema"] = json.loads(request.json_schema)
        data = json.dumps(body).encode()
        http = urllib.request.Request(server.url + "/completion", data=data,
                                      headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(http, timeout=900) as reply:
            answer = json.loads(reply.read())
        return int(answer.get("tokens_predicted", 0)), str(answer.get("content", ""))
    return server, serve


def summary(goals: Sequence[Goal], wall: float) -> Dict[str, Any]:
    latencies = sorted(goal.latency for goal in goals)
    tokens = sum(goal.tokens for goal in goals)
    nan = float("nan")
    return {"goals": len(goals), "errors": sum(1 for goal in goals if goal.error), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else nan,
            "latency_median_s": statistics.median(latencies) if latencies else nan,
            "latency_p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))] if latencies else nan}


def split(requests: Sequence[TraceRequest], n_clients: int, per_client: int) -> List[List[TraceRequest]]:
    """Client i's goals: requests i, i + N, i + 2N, ... (``per_client`` of them)."""
    return [[requests[(i + n_clients * j) % len(requests)] for j in range(per_client)] for i in range(n_clients)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemma_spec_dev.bench.clients",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="", help="node params file (default: the embedded profile)")
    parser.add_argument("--clients", default="1,2,3,4", help="client counts, comma-separated")
    parser.add_argument("--modes", default="off,lookup", help="engine modes, comma-separated")
    parser.add_argument("--servers", default=",".join(SERVER_SETTINGS),
                        help="llama-server settings ('' = none), comma-separated")
    parser.add_argument("--native-bin", default=str(Path("~/.cache/gemma_spec_ros/native/bin").expanduser()))
    parser.add_argument("--goals-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--constrained", action="store_true", help="the planner goals with their plan schema")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_clients")
    args = parser.parse_args(argv)
    params = load_params(args.config) if args.config else default_params()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = trace_requests("planner", args.constrained)
    counts = [int(n) for n in args.clients.split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    servers = [s for s in args.servers.split(",") if s]
    bin_dir = Path(args.native_bin)
    if servers and not (bin_dir / "llama-server").is_file():
        print(f"no llama-server in {bin_dir} (scripts/build_native_tools.sh): its runners are left out",
              file=sys.stderr)
        servers = []
    runs: List[Dict[str, Any]] = []
    for repeat in range(args.repeats):
        for n in counts:
            goals = split(requests, n, args.goals_per_client)
            runners = ([(f"together/{m}", "engine", m, n) for m in modes]
                       + [(f"one-at-a-time/{m}", "engine", m, 1) for m in modes if n > 1]
                       + [(f"llama-server/{s}", "server", s, n) for s in servers])
            shift = repeat % len(runners)
            for name, kind, what, slots in runners[shift:] + runners[:shift]:
                if kind == "engine":
                    holder, serve = engine_server(params, what, slots)
                else:
                    holder, serve = llama_server(params, what, slots, bin_dir, out)
                kv = float("nan")
                try:
                    done, wall = run_clients(serve, goals, args.max_tokens)
                    if kind == "engine":
                        kv = kv_bytes_per_token(holder)
                finally:
                    if kind == "engine":
                        holder.close()
                    else:
                        holder.stop()
                row = {"repeat": repeat, "clients": n, "runner": name, **summary(done, wall),
                       "kv_bytes_per_token": kv, "n_ctx": int(model_config(params, "target").n_ctx),
                       "goals_detail": [dataclasses.asdict(g) | {"latency_s": g.latency} for g in done]}
                runs.append(row)
                print(f"[clients] repeat {repeat} N={n} {name}: {row['tokens_per_s']:.1f} tok/s, "
                      f"latency median {row['latency_median_s']:.2f} s, errors {row['errors']}", flush=True)
    kv = [r["kv_bytes_per_token"] for r in runs if r["kv_bytes_per_token"] == r["kv_bytes_per_token"]]
    results = {"machine": machine_info(), "args": vars(args), "runs": runs, "table": table(runs),
               "kv_bytes_per_token": statistics.median(kv) if kv else None}
    (out / "clients.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    (out / "clients.md").write_text(markdown(results["table"], args, results["kv_bytes_per_token"],
                                             int(model_config(params, "target").n_ctx)), encoding="utf-8")
    plot(results["table"], out / "clients.png")
    print((out / "clients.md").read_text(encoding="utf-8"))
    return 0


def table(runs: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Per client count and runner: medians over repeats, and the same-run ratios."""
    rows: List[Dict[str, Any]] = []
    keys = sorted({(r["clients"], r["runner"]) for r in runs})
    by_key = {key: [r for r in runs if (r["clients"], r["runner"]) == key] for key in keys}
    for (n, runner), rs in by_key.items():
        rows.append({"clients": n, "runner": runner,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "latency_median_s": statistics.median(r["latency_median_s"] for r in rs),
                     "latency_p90_s": statistics.median(r["latency_p90_s"] for r in rs),
                     "errors": sum(r["errors"] for r in rs)})

    def ratio(n: int, runner: str, other: str) -> float:
        pairs = [(a["tokens_per_s"], b["tokens_per_s"]) for a in runs for b in runs
                 if a["clients"] == b["clients"] == n and a["repeat"] == b["repeat"]
                 and a["runner"] == runner and b["runner"] == other]
        return statistics.median(x / y for x, y in pairs) if pairs else float("nan")
    for row in rows:
        n, runner = row["clients"], row["runner"]
        if runner.startswith("together/"):
            mode = runner.split("/", 1)[1]
            row["vs_one_at_a_time"] = ratio(n, runner, f"one-at-a-time/{mode}") if n > 1 else 1.0
            servers = [r for r in rows if r["clients"] == n and r["runner"].startswith("llama-server/")]
            if servers:
                best = max(servers, key=lambda r: r["tokens_per_s"])
                row["best_server"] = best["runner"]
                row["vs_best_server"] = ratio(n, runner, best["runner"])
    return rows


def markdown(rows: Sequence[Mapping[str, Any]], args: argparse.Namespace, kv_per_token: Optional[float],
             n_ctx: int) -> str:
    lines = [f"# Several clients at once ({args.goals_per_client} goals per client, {args.max_tokens} tokens, "
             f"greedy, {'plan schema' if args.constrained else 'free text'}, {args.repeats} repeats)", "",
             "| clients | runner | tokens/s | vs one at a time | vs best llama-server | latency median (s) | "
             "latency p90 (s) | errors |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        vs_one, vs_server = row.get("vs_one_at_a_time"), row.get("vs_best_server")
        one = "" if vs_one is None else f"{vs_one:.2f}x"
        server = "" if vs_server is None else f"{vs_server:.2f}x ({row['best_server']})"
        lines.append(f"| {row['clients']} | {row['runner']} | {row['tokens_per_s']:.1f} | {one} | {server} | "
                     f"{row['latency_median_s']:.2f} | {row['latency_p90_s']:.2f} | {row['errors']} |")
    if kv_per_token:
        lines += ["", f"KV cache per slot: {kv_per_token / 1024:.1f} KiB per token x n_ctx {n_ctx} = "
                      f"{kv_per_token * n_ctx / 2**20:.0f} MiB (llama.cpp's state of a sequence, full window)."]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: WPS433  only the report needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: WPS433
    figure, axis = plt.subplots(figsize=(7, 4))
    for runner in sorted({row["runner"] for row in rows}):
        points = sorted((row["clients"], row["tokens_per_s"]) for row in rows if row["runner"] == runner)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=runner)
    axis.set_xlabel("clients at once")
    axis.set_ylabel("total tokens/s")
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
