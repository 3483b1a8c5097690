"""The same requests through the engines of two checkouts of this repository, interleaved: is one
slower? (docs/benchmarks.md, "EAGLE-3 on the tiny pair": off, lookup, draft and mtp with no EAGLE-3
head loaded, before and after EAGLE-3 support).

    git worktree add --detach /tmp/old COMMIT
    .venv/bin/python scripts/checkout_ab.py /tmp/old . --modes off,lookup,draft,mtp --rounds 8

Each checkout's ``gemma_spec_ros`` runs in a worker process of its own (first on its PYTHONPATH, this
venv's llama-cpp-python), one engine per mode kept for the whole run; a round sends one request to
every worker in turn, the order rotating each round. Per mode it prints ms per target pass (quartiles
and range) and each round's ratio NEW / OLD, and checks that both emitted the same tokens in as many
passes (fixed K 3, greedy: the same work). Modes ``off``, ``lookup``, ``draft`` run the embedded
Gemma 3 270M (``draft``: the same file as its own draft model); ``mtp`` and ``eagle3`` the tests'
tiny agreeing Gemma 4 pairs (test/support/tiny_gemma4.py, tiny_eagle3.py), written into a temporary
folder. One thread a model. With ``--planner`` the embedded model's request is the planner suite's
first instruction (its system prompt, the chat template) under the plan schema: constrained output.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Dict, List, Tuple

EMBEDDED = os.path.expanduser("~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf")
CODE_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
TINY_PROMPT = "the robot picks up the red cup. "


def quartiles(values: List[float]) -> str:
    """'median (q1-q3, min-max)' of ``values``."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{median:.3f} ({q1:.3f}-{q3:.3f}, {min(values):.3f}-{max(values):.3f})"


def planner_request() -> dict:
    """The planner suite's first instruction, its system prompt and the plan schema."""
    import yaml  # noqa: WPS433

    suite_file = Path(__file__).resolve().parent.parent / "gemma_spec_ros" / "prompts" / "planner.yaml"
    suite = yaml.safe_load(suite_file.read_text())
    schema = (suite_file.parent / suite["json_schema_file"]).read_text()
    return dict(prompt=suite["prompts"][0]["text"], system=suite["system"], json_schema=schema)


def mode_config(mode: str, tokens: int, tiny_tokens: int, tiny_pairs: Dict[str, Tuple[str, str]],
                planner: bool = False) -> dict:
    """What a worker builds for ``mode``: model files, prompt, request length."""
    if mode in tiny_pairs:
        target, draft = tiny_pairs[mode]
        return dict(mode=mode, target=target, draft=draft, prompt=TINY_PROMPT, tokens=tiny_tokens)
    request = planner_request() if planner else dict(prompt=CODE_PROMPT)
    return dict(mode=mode, target=EMBEDDED, draft=EMBEDDED if mode == "draft" else "", tokens=tokens, **request)


def worker(config: dict) -> None:
    """One engine (this checkout's code); each line on stdin runs the request once and prints
    {ms_per_pass, passes, digest} as JSON."""
    from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SpecConfig
    from gemma_spec_ros.engine.engine import Engine
    from gemma_spec_ros.engine.request import GenerationRequest

    def model(path: str, n_ctx: int = 0) -> ModelConfig:
        return ModelConfig(path, n_ctx=n_ctx or config["tokens"] + 128, n_threads=1, flash_attn=True)

    system = config.get("system", "")
    engine = Engine(EngineConfig(target=model(config["target"], 2048 if system else 0),
                                 draft=model(config["draft"]) if config["draft"] else None,
                                 spec=SpecConfig(mode=config["mode"], draft_max=3, p_min=0.75, adaptive=False)))
    request = GenerationRequest(config["prompt"], max_tokens=config["tokens"], system_prompt=system,
                                use_chat_template=bool(system), json_schema=config.get("json_schema", ""))
    print("ready", flush=True)
    try:
        for _ in sys.stdin:
            steps = list(engine.generate(request))
            stats = steps[-1].stats
            tokens = [t for step in steps for t in step.tokens]
            print(json.dumps(dict(ms_per_pass=stats.generation_time / stats.num_steps * 1e3,
                                  passes=stats.num_steps, masks=stats.num_grammar_masks,
                                  digest=zlib.crc32(json.dumps(tokens).encode()))),
                  flush=True)
    finally:
        engine.close()


def start(checkout: Path, config: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(checkout / "gemma_spec_ros"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(config)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(checkout))
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the worker of {checkout} did not start")
    return process


def ask(process: subprocess.Popen) -> dict:
    process.stdin.write("go\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def compare(mode: str, checkouts: List[Path], rounds: int, config: dict) -> None:
    workers = [start(c, config) for c in checkouts]
    results: Dict[int, List[dict]] = {0: [], 1: []}
    try:
        for r in range(rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                results[i].append(ask(workers[i]))
    finally:
        for process in workers:
            process.stdin.close()
            process.wait()
    old, new = ([x["ms_per_pass"] for x in results[i]] for i in (0, 1))
    same = {(x["passes"], x["digest"]) for i in (0, 1) for x in results[i]}
    paired = [b / a for a, b in zip(old, new)]
    load, ratio = os.getloadavg()[0], statistics.median(new) / statistics.median(old)
    rounds_of = [[(x["passes"], x["digest"]) for x in results[i]] for i in (0, 1)]
    if len(same) == 1:
        outputs = "same tokens and passes"
    elif rounds_of[0] == rounds_of[1]:  # a mode that learns across requests: each round its own text
        outputs = f"same tokens and passes round by round (passes {[p for p, _ in rounds_of[0]]})"
    else:
        outputs = f"OUTPUTS DIFFER: old {rounds_of[0]}, new {rounds_of[1]}"
    masks = [statistics.median(x.get("masks", 0) for x in results[i]) for i in (0, 1)]
    masked = f"; grammar masks per request: old {masks[0]:g}, new {masks[1]:g}" if any(masks) else ""
    print(f"{mode}: {rounds} rounds, ms per target pass: old {quartiles(old)}, new {quartiles(new)}; "
          f"new/old per round {quartiles(paired)}, ratio of medians {ratio:.3f}; {outputs}{masked}; "
          f"load {load:.1f}", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--modes", default="off,lookup,draft,mtp")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96, help="per request on the embedded model")
    parser.add_argument("--tiny-tokens", type=int, default=1500, help="per request on a tiny pair")
    parser.add_argument("--planner", action="store_true",
                        help="the embedded model's request: a planner instruction under the plan schema")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test"))
    from support.tiny_eagle3 import write_eagle3_pair  # the tests' writers, this checkout's
    from support.tiny_gemma4 import write_gemma4_pair
    checkouts = [args.old.resolve(), args.new.resolve()]
    print(f"old {checkouts[0]}, new {checkouts[1]}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        tiny = {"mtp": write_gemma4_pair(Path(folder, "mtp"), agreeing=True),
                "eagle3": write_eagle3_pair(Path(folder, "eagle3"), agreeing=True)}
        pairs = {mode: (str(target), str(draft)) for mode, (target, draft) in tiny.items()}
        for mode in args.modes.split(","):
            compare(mode, checkouts, args.rounds,
                    mode_config(mode, args.tokens, args.tiny_tokens, pairs, args.planner))


if __name__ == "__main__":
    main()
