"""An EAGLE-3 head measured against off, lookup and a draft model on the same prompts: tau, draft
cost, tokens/s; and, for a Gemma 3 target, what copying its features costs a pass. Writes JSON.

    .venv/bin/python scripts/eagle3_gpu_check.py --target gemma-3-4b-it-Q4_K_M.gguf \\
        --head gemma-3-4b-it-eagle3-F32.gguf [--draft-model gemma-3-270m-it-Q4_K_M.gguf] \\
        [--prompts prompts.jsonl] [--chat] [--k 3] [--max-tokens 256] [--rounds 3] --out check.json
    .venv/bin/python scripts/eagle3_gpu_check.py --smoke --out smoke.json   # any machine, ~minutes

Made for a GPU machine (``--n-gpu-layers -1``, the default: every layer of the target and the head
offloaded; a CPU build runs it on the CPU). ``--smoke`` runs it end to end on the embedded Gemma 3
270M with a random head it writes (SpecForge's layout, converted by gemma-spec-eagle3-convert): a
check of the plumbing, whose figures mean nothing (a random head is rejected).

What it runs, in one process, each request greedy (``temperature`` 0) from an empty cache:

- an engine of the target + the head (``spec.mode`` per request): ``off``; ``lookup`` (adaptive,
  as configured by default); ``eagle3`` at a fixed K (``--k``, p_min ``--p-min``); ``eagle3``
  with the adaptive policy (K up to ``--k``); ``auto``;
- with ``--draft-model``, an engine of the target + that model: ``draft`` at the fixed K;
- ``--rounds`` rounds over every prompt, the modes interleaved per prompt; the first request of
  each engine is a warm-up, not counted.

Per mode: tokens/s (generated tokens over generation time, the prompt's pass excluded; the median of
the rounds), speedup over ``off`` (ratio of the medians), tau = 1 + accepted / drafts (the engine's
``mean_acceptance_length`` over all requests), acceptance per draft position, draft milliseconds per
draft and per drafted token, verify milliseconds per pass, and the share of requests whose text is
``off``'s (greedy: equal unless a near-tie breaks the other way on a non-batch-invariant backend).
Also the cost model's V(1), V(K + 1) and the head's draft cost, and for a gemma3 target the capture
cost (scripts/eagle3_capture_cost.py: 1-row and 5-row passes without a head, with one not drafting,
with one drafting). ``verdict`` compares with the targets of docs/deployment.md ("Training a head"):
tau >= 2.5 at K = 3, a draft step <= 10 % of a 1-row target pass, tokens/s >= 1.5x off and >= 1.1x
lookup.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eagle3_capture_cost  # noqa: E402  (scripts/, beside this file)

from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig  # noqa: E402
from gemma_spec_ros.engine.drafters.eagle3 import is_eagle3_head  # noqa: E402
from gemma_spec_ros.engine.engine import Engine  # noqa: E402
from gemma_spec_ros.engine.llama.gguf import architecture  # noqa: E402
from gemma_spec_ros.engine.llama.model import LlamaModel  # noqa: E402
from gemma_spec_ros.engine.llama.process import load_llama_cpp  # noqa: E402
from gemma_spec_ros.engine.request import GenerationRequest  # noqa: E402

PROMPTS = (
    "Explain in a few sentences how a robot arm picks up a cup from a table.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five safety checks a mobile robot should run before it starts moving.",
    "Summarise the plot of a short story about a lighthouse keeper who finds a message in a bottle.",
    'Plan the robot\'s next three actions as JSON: {"actions": [{"action": ..., "object": ...}]}.',
    "Translate into French: The robot picks up the red cup and puts it on the shelf.",
)
#: the targets of docs/deployment.md ("Training a head") a head has to meet to be worth it
VERDICT = dict(tau_at_k3=2.5, draft_step_share=0.10, speedup_vs_off=1.5, speedup_vs_lookup=1.1)


# -- a random head for --smoke -------------------------------------------------------------------------
def write_random_head(directory: Path, target: str, seed: int = 0, n_draft: int = 4096) -> Path:
    """A random EAGLE-3 head for ``target`` in SpecForge's layout (config.json + safetensors),
    converted by gemma-spec-eagle3-convert at F32: one layer of the target's width, 2 heads x 64,
    FFN 256, a draft vocabulary of ``n_draft`` tokens, reading the trainers' default layers."""
    from safetensors.numpy import save_file

    from gemma_spec_ros.tools.eagle3_convert import convert

    llama_cpp = load_llama_cpp()
    model = LlamaModel(ModelConfig(target, n_ctx=256, n_gpu_layers=0))
    try:
        n_embd = int(llama_cpp.llama_model_n_embd(model.handles[0]))
        n_layer = int(llama_cpp.llama_model_n_layer(model.handles[0]))
        n_vocab = model.n_vocab
    finally:
        model.close()
    rng = np.random.default_rng(seed)
    n_head, head_dim, n_ff = 2, 64, 256

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    d2t = np.sort(rng.choice(np.arange(3, n_vocab), size=min(n_draft, n_vocab - 3), replace=False))
    t2d = np.zeros(n_vocab, dtype=bool)
    t2d[d2t] = True
    layer = "midlayer."
    tensors = {
        "fc.weight": matrix(n_embd, 3 * n_embd), "norm.weight": np.ones(n_embd, np.float32),
        "lm_head.weight": matrix(len(d2t), n_embd), "d2t": (d2t - np.arange(len(d2t))).astype(np.int64),
        "t2d": t2d,
        layer + "input_layernorm.weight": np.ones(n_embd, np.float32),
        layer + "hidden_norm.weight": np.ones(n_embd, np.float32),
        layer + "post_attention_layernorm.weight": np.ones(n_embd, np.float32),
        layer + "self_attn.q_proj.weight": matrix(n_head * head_dim, 2 * n_embd),
        layer + "self_attn.k_proj.weight": matrix(head_dim, 2 * n_embd),
        layer + "self_attn.v_proj.weight": matrix(head_dim, 2 * n_embd),
        layer + "self_attn.o_proj.weight": matrix(n_embd, n_head * head_dim),
        layer + "mlp.gate_proj.weight": matrix(n_ff, n_embd), layer + "mlp.up_proj.weight": matrix(n_ff, n_embd),
        layer + "mlp.down_proj.weight": matrix(n_embd, n_ff),
    }
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=n_embd,
                  num_attention_heads=n_head, num_key_value_heads=1, head_dim=head_dim, intermediate_size=n_ff,
                  num_hidden_layers=1, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=32768, vocab_size=n_vocab, draft_vocab_size=len(d2t),
                  target_model_type=architecture(target) or "", tie_word_embeddings=False,
                  eagle_config=dict(eagle_aux_hidden_state_layer_ids=[1, n_layer // 2 - 1, n_layer - 4]))
    folder = directory / "specforge-random-head"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    out = directory / "random-eagle3-F32.gguf"
    convert(folder, Path(target), out, outtype="f32")
    return out


# -- prompts and runs ----------------------------------------------------------------------------------
def load_prompts(path: Optional[str]) -> List[str]:
    """One prompt a line (.txt), or a JSON list / JSON lines of strings, of objects with ``prompt``
    (or ``text``), or of conversations (``conversations``: the first user turn; what
    gemma-spec-export-traffic and SpecForge's prepare_data.py write)."""
    if not path:
        return list(PROMPTS)
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".txt"):
        return [line for line in text.splitlines() if line.strip()]
    items = json.loads(text) if text.lstrip().startswith("[") else [
        json.loads(line) for line in text.splitlines() if line.strip()]
    return [p for p in (prompt_of(item) for item in items) if isinstance(p, str) and p]


def prompt_of(item: Any) -> Optional[str]:
    """A row's prompt: the string itself, its ``prompt``/``text``, or its first user turn."""
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        return None
    for turn in item.get("conversations") or ():
        if isinstance(turn, dict) and (turn.get("role") or turn.get("from")) in ("user", "human"):
            return turn.get("content") or turn.get("value")
    return item.get("prompt") or item.get("text")


def one_request(engine: Engine, prompt: str, mode: str, max_tokens: int, chat: bool) -> Dict[str, Any]:
    request = GenerationRequest(prompt, max_tokens=max_tokens, spec_mode=mode, sampling=SamplingParams(),
                                use_chat_template=chat, reuse_prompt=False)
    steps = list(engine.generate(request))
    stats = steps[-1].stats
    return dict(tokens=[t for s in steps for t in s.tokens], generated=stats.num_generated_tokens,
                seconds=stats.generation_time, drafts=stats.num_drafts, drafted=stats.num_draft_tokens,
                accepted=stats.num_accepted_tokens, steps=stats.num_steps, draft_time=stats.draft_time,
                verify_time=stats.verify_time, drafted_at=list(stats.drafted_at),
                accepted_at=list(stats.accepted_at), finish=steps[-1].finish_reason)


def summary(runs: List[List[Dict[str, Any]]], reference: Dict[int, List[int]]) -> Dict[str, Any]:
    """A mode's figures from its runs (per round, the requests of every prompt)."""
    flat = [r for round_ in runs for r in round_]
    speeds = [sum(r["generated"] for r in round_) / max(1e-9, sum(r["seconds"] for r in round_))
              for round_ in runs]
    drafts, drafted = sum(r["drafts"] for r in flat), sum(r["drafted"] for r in flat)
    accepted, steps = sum(r["accepted"] for r in flat), sum(r["steps"] for r in flat)
    width = max((len(r["drafted_at"]) for r in flat), default=0)
    at = [sum(r["drafted_at"][i] for r in flat if i < len(r["drafted_at"])) for i in range(width)]
    ok = [sum(r["accepted_at"][i] for r in flat if i < len(r["accepted_at"])) for i in range(width)]
    same = [r["tokens"] == reference.get(i) for round_ in runs for i, r in enumerate(round_)]
    return dict(
        tokens_per_s=statistics.median(speeds), tokens_per_s_rounds=speeds,
        tau=1.0 + accepted / drafts if drafts else None, drafts=drafts, drafted_tokens=drafted,
        accepted_tokens=accepted, acceptance_per_position=[a / d if d else 0.0 for a, d in zip(ok, at)],
        draft_ms_per_draft=1e3 * sum(r["draft_time"] for r in flat) / drafts if drafts else None,
        draft_ms_per_token=1e3 * sum(r["draft_time"] for r in flat) / drafted if drafted else None,
        verify_ms_per_pass=1e3 * sum(r["verify_time"] for r in flat) / steps if steps else None,
        tokens_per_pass=sum(r["generated"] for r in flat) / steps if steps else None,
        same_text_as_off=sum(same) / len(same) if same else None,
        finish_reasons=sorted({r["finish"] for r in flat}))


def run_engine(config: EngineConfig, modes: Sequence[Tuple[str, str, bool]], prompts: Sequence[str],
               args: argparse.Namespace, reference: Dict[int, List[int]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """({label: summary}, the engine's cost model figures) of ``modes`` = (label, spec mode, adaptive)."""
    engine = Engine(config)
    try:
        base = engine.spec
        one_request(engine, prompts[0], "off", 8, args.chat)  # warm-up
        runs: Dict[str, List[List[Dict[str, Any]]]] = {label: [] for label, _, _ in modes}
        for _ in range(args.rounds):
            for label, _, _ in modes:
                runs[label].append([])
            for i, prompt in enumerate(prompts):
                for label, mode, adaptive in modes:
                    engine.update_spec(dataclasses.replace(base, adaptive=adaptive))
                    result = one_request(engine, prompt, mode, args.max_tokens, args.chat)
                    if mode == "off" and i not in reference:
                        reference[i] = result["tokens"]
                    runs[label][-1].append(result)
                    progress(f"{label} prompt {i + 1}/{len(prompts)}: {result['generated']} tokens, "
                             f"{result['generated'] / max(1e-9, result['seconds']):.1f} tok/s")
        costs = engine.costs
        k_rows = args.k + 1
        v1, vk = costs.verify_cost(1) or float("nan"), costs.verify_cost(k_rows) or float("nan")
        figures = dict(v1_ms=1e3 * v1, v_k1_ms=1e3 * vk, v_k1_over_v1=vk / v1)
        for name in engine.drafters:
            if name in ("eagle3", "draft"):
                figures[f"{name}_draft_ms_for_k"] = 1e3 * costs.draft_cost(name, args.k)
        return {label: summary(runs[label], reference) for label in runs}, figures
    finally:
        engine.close()


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def machine() -> Dict[str, Any]:
    llama_cpp = load_llama_cpp()
    return dict(platform=platform.platform(), python=platform.python_version(), cpus=os.cpu_count(),
                gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
                system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                llama_cpp=Path(llama_cpp.__file__).parent.as_posix())


def verdict(modes: Dict[str, Any], costs: Dict[str, Any], k: int) -> Dict[str, Any]:
    off, lookup, head = modes.get("off"), modes.get("lookup"), modes.get(f"eagle3 K={k}")
    out: Dict[str, Any] = {"targets": VERDICT}
    if head and off:
        out["tau"] = head["tau"]
        out["tau_ok"] = bool(k == 3 and head["tau"] is not None and head["tau"] >= VERDICT["tau_at_k3"])
        best = max((m["tokens_per_s"] for label, m in modes.items() if label.startswith("eagle3")), default=0.0)
        out["speedup_vs_off"] = best / off["tokens_per_s"]
        out["speedup_ok_vs_off"] = out["speedup_vs_off"] >= VERDICT["speedup_vs_off"]
        if lookup:
            out["speedup_vs_lookup"] = best / lookup["tokens_per_s"]
            out["speedup_ok_vs_lookup"] = out["speedup_vs_lookup"] >= VERDICT["speedup_vs_lookup"]
    step = costs.get("eagle3_draft_ms_for_k")
    if step is not None and costs.get("v1_ms"):
        out["draft_step_share"] = step / k / costs["v1_ms"]
        out["draft_step_ok"] = out["draft_step_share"] <= VERDICT["draft_step_share"]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="the target GGUF (--smoke: the embedded model by default)")
    parser.add_argument("--head", help="the head's eagle3 GGUF (--smoke: a random one is written)")
    parser.add_argument("--draft-model", help="a standalone draft model GGUF of the target's vocabulary")
    parser.add_argument("--prompts", help="prompts: .txt (one a line), JSON list or JSON lines with 'prompt'")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--k", type=int, default=3, help="draft length (fixed K; the adaptive runs' cap)")
    parser.add_argument("--p-min", type=float, default=0.0, help="the fixed-K runs' p_min")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="-1: all (ignored by a CPU build)")
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--no-capture-cost", action="store_true", help="skip the capture-cost table")
    parser.add_argument("--smoke", action="store_true",
                        help="the embedded model, a random head, 2 prompts, 24 tokens, 1 round")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    started = time.time()
    prompts = load_prompts(args.prompts)
    scratch = None
    if args.smoke:
        args.target = args.target or str(eagle3_capture_cost.DEFAULT_MODEL)
        args.max_tokens, args.rounds, args.n_ctx = min(args.max_tokens, 24), 1, min(args.n_ctx, 512)
        prompts = prompts[:2]
        if not args.head:
            scratch = tempfile.TemporaryDirectory(prefix="eagle3-smoke-")
            progress("writing a random head (SpecForge layout) and converting it ...")
            args.head = str(write_random_head(Path(scratch.name), args.target))
    if not args.target or not args.head:
        parser.error("--target and --head are required (or --smoke)")
    if not is_eagle3_head(args.head):
        parser.error(f"{args.head} is no eagle3 GGUF")
    try:
        def model(path: str) -> ModelConfig:
            return ModelConfig(path, n_ctx=args.n_ctx, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
                               flash_attn=True)

        spec = SpecConfig(mode="eagle3", draft_max=args.k, p_min=args.p_min, adaptive=False)
        reference: Dict[int, List[int]] = {}
        k = args.k
        modes, costs = run_engine(
            EngineConfig(target=model(args.target), draft=model(args.head), spec=spec),
            [("off", "off", False), ("lookup", "lookup", True), (f"eagle3 K={k}", "eagle3", False),
             ("eagle3 adaptive", "eagle3", True), ("auto", "auto", True)], prompts, args, reference)
        if args.draft_model:
            more, draft_costs = run_engine(
                EngineConfig(target=model(args.target), draft=model(args.draft_model),
                             spec=dataclasses.replace(spec, mode="draft")),
                [(f"draft K={k}", "draft", False)], prompts, args, reference)
            modes.update(more)
            costs.update({key: value for key, value in draft_costs.items() if key.startswith("draft")})
        off = modes["off"]["tokens_per_s"]
        for figures in modes.values():
            figures["speedup_vs_off"] = figures["tokens_per_s"] / off if off else None
        capture = None
        if architecture(args.target) == "gemma3" and not args.no_capture_cost:
            progress("capture cost ...")
            capture = eagle3_capture_cost.measure(args.target, rounds=1 if args.smoke else 5,
                                                  reps=3 if args.smoke else 15, threads=args.threads or 1,
                                                  n_gpu_layers=args.n_gpu_layers)
        result = dict(
            machine=machine(), smoke=args.smoke, seconds=time.time() - started,
            settings=dict(target=args.target, head=args.head, draft_model=args.draft_model, k=k,
                          p_min=args.p_min, max_tokens=args.max_tokens, rounds=args.rounds,
                          n_prompts=len(prompts), chat=args.chat, n_ctx=args.n_ctx,
                          n_gpu_layers=args.n_gpu_layers, target_architecture=architecture(args.target)),
            modes=modes, costs=costs, capture_cost=capture, verdict=verdict(modes, costs, k))
        Path(args.out).write_text(json.dumps(result, indent=2))
        for label, figures in modes.items():
            tau = "" if figures["tau"] is None else f"  tau {figures['tau']:.2f}"
            print(f"{label:16s} {figures['tokens_per_s']:8.1f} tok/s  x{figures['speedup_vs_off']:.2f}{tau}")
        if capture:
            print(eagle3_capture_cost.markdown(capture))
        print(f"verdict: {json.dumps(result['verdict'])}")
        print(f"wrote {args.out}")
        return 0
    finally:
        if scratch is not None:
            scratch.cleanup()


if __name__ == "__main__":
    sys.exit(main())
