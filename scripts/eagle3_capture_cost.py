"""What copying a Gemma 3 target's layer features costs a target pass (engine/llama/features.py).

    .venv/bin/python scripts/eagle3_capture_cost.py [--model GGUF] [--rounds 5] [--reps 15] [--json OUT]

Four contexts of the same model, timed interleaved (one pass of each in turn, so that the host's load
falls on all alike), a 1-row pass (its logits) and a 5-row pass (every row's logits: a K = 4 verify
pass) at position ``--position``, each rolled back after it:

- ``no head``: no eval callback, what every configuration without an EAGLE-3 head loads;
- ``no head (2nd)``: another such context: the difference between the two is the noise floor;
- ``head, not drafting``: the callback installed, copying nothing (a head loaded, the step's mode
  does not draft with it): it returns at once for each of the graph's nodes;
- ``head, drafting``: copying the three features of the head (the inputs of layers 2, 9, 14 of
  the 270M model's 18) and handing the rows over, as the drafter does after each pass.

Each round gives each context's median over ``--reps`` passes; the table has the median over the
rounds of each round's ratio to ``no head``. Wall time with ``--threads`` (default 1) and the
calling thread's CPU time (with one thread all of a pass's compute, robust to preemption by other
work). The model defaults to the embedded one (Gemma 3 270M Q4_K_M).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from gemma_spec_ros.engine.config import ModelConfig
from gemma_spec_ros.engine.llama.features import FeatureCapture
from gemma_spec_ros.engine.llama.model import LlamaModel

DEFAULT_MODEL = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros") / \
    "models" / "gemma-3-270m-q4_k_m.gguf"
LAYERS = (2, 9, 14)
KINDS = ("no head", "no head (2nd)", "head, not drafting", "head, drafting")
FILLER = "The robot picks up the red cup and puts it on the table, then it goes back to the shelf. "


def contexts(model: str, threads: int, n_ctx: int, n_gpu_layers: int = 0) -> Dict[str, LlamaModel]:
    config = ModelConfig(model, n_ctx=n_ctx, n_threads=threads, n_gpu_layers=n_gpu_layers)
    out: Dict[str, LlamaModel] = {}
    for kind in KINDS:
        capture = FeatureCapture() if kind.startswith("head") else None
        target = LlamaModel(config, eval_callback=None if capture is None else capture.function)
        if capture is not None:
            n_embd = int(target._llama_cpp.llama_model_n_embd(target.handles[0]))
            capture.want(LAYERS, n_embd, target.n_batch)
            capture.enable(kind == "head, drafting")
        out[kind] = target
    return out


def timed_pass(target: LlamaModel, tokens: Sequence[int]) -> List[float]:
    """(wall, thread CPU) seconds of one pass over ``tokens`` (every row's logits), then rolled
    back; the copied features are handed over as the drafter takes them."""
    n_keep = target.n_past
    wall, cpu = time.perf_counter(), time.thread_time()
    target.decode(list(tokens), range(len(tokens)))
    capture = getattr(target.eval_callback, "capture", None)
    if capture is not None and capture.enabled:
        [row.copy() for row in capture.rows()]
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    target.rollback(n_keep)
    return [wall, cpu]


def measure(model: str, rounds: int, reps: int, threads: int = 1, position: int = 128,
            rows: Sequence[int] = (1, 5), n_gpu_layers: int = 0) -> Dict[str, object]:
    """{rows: {kind: {"wall_ms", "cpu_ms", "wall_ratio", "cpu_ratio"}}}: medians over the rounds."""
    targets = contexts(model, threads, max(512, position + 64), n_gpu_layers)
    try:
        prefix = targets["no head"].tokenize(FILLER * (position // 8 + 2))[:position]
        for target in targets.values():
            target.decode(prefix, [len(prefix) - 1])
            for n in rows:  # warm: the graphs of these shapes built, their buffers touched
                timed_pass(target, prefix[1:1 + n])
        result: Dict[str, object] = {}
        for n in rows:
            batch = prefix[1:1 + n]
            per_round: Dict[str, List[List[float]]] = {kind: [] for kind in KINDS}
            for _ in range(rounds):
                samples: Dict[str, List[List[float]]] = {kind: [] for kind in KINDS}
                for _ in range(reps):
                    for kind in KINDS:
                        samples[kind].append(timed_pass(targets[kind], batch))
                for kind in KINDS:
                    per_round[kind].append([statistics.median(s[i] for s in samples[kind]) for i in (0, 1)])
            table = {}
            for kind in KINDS:
                ratios = [[mine[i] / base[i] for i in (0, 1)]
                          for mine, base in zip(per_round[kind], per_round["no head"])]
                table[kind] = dict(
                    wall_ms=1e3 * statistics.median(r[0] for r in per_round[kind]),
                    cpu_ms=1e3 * statistics.median(r[1] for r in per_round[kind]),
                    wall_ratio=statistics.median(r[0] for r in ratios),
                    cpu_ratio=statistics.median(r[1] for r in ratios),
                    wall_ratio_range=[min(r[0] for r in ratios), max(r[0] for r in ratios)])
            result[str(n)] = table
        result["callback_calls"] = callback_calls(model, threads, rows, n_gpu_layers)
        return result
    finally:
        for target in targets.values():
            target.close()


def callback_calls(model: str, threads: int, rows: Sequence[int] = (1, 5), n_gpu_layers: int = 0) -> Dict[str, int]:
    """How many graph nodes the eval callback is asked about in a pass of each row count (a
    callback that counts them, in a context of its own)."""
    import llama_cpp

    asked = [0]

    def count(tensor: int, ask: bool, user_data: int) -> bool:
        asked[0] += ask
        return not ask

    function = llama_cpp.ggml_backend_sched_eval_callback(count)
    target = LlamaModel(ModelConfig(model, n_ctx=512, n_threads=threads, n_gpu_layers=n_gpu_layers),
                        eval_callback=function)
    try:
        prefix = target.tokenize(FILLER * 4)[:64]
        target.decode(prefix, [len(prefix) - 1])
        out = {}
        for n in rows:
            asked[0] = 0
            timed_pass(target, prefix[1:1 + n])
            out[str(n)] = asked[0]
        return out
    finally:
        target.close()


def markdown(result: Dict[str, object]) -> str:
    lines = ["| pass | context | wall ms | vs no head | thread CPU ms | vs no head |",
             "|---|---|---|---|---|---|"]
    for n, table in result.items():
        if n == "callback_calls":
            continue
        for kind, row in table.items():
            lines.append(f"| {n} row{'s' if n != '1' else ''} | {kind} | {row['wall_ms']:.2f} | "
                         f"{100 * (row['wall_ratio'] - 1):+.1f} % | {row['cpu_ms']:.2f} | "
                         f"{100 * (row['cpu_ratio'] - 1):+.1f} % |")
    calls = result.get("callback_calls")
    if calls:
        lines.append("")
        lines.append("graph nodes the callback is asked about per pass: " +
                     ", ".join(f"{n} row{'s' if n != '1' else ''}: {c}" for n, c in calls.items()))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a gemma3 GGUF (default: the embedded model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=15, help="passes of each context per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--position", type=int, default=128, help="context length before the timed pass")
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    result = measure(args.model, args.rounds, args.reps, args.threads, args.position,
                     n_gpu_layers=args.n_gpu_layers)
    print(f"{args.model}: {args.rounds} rounds x {args.reps} passes, {args.threads} thread(s), "
          f"position {args.position}; medians over the rounds")
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
