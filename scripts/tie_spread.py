"""How far running beside other requests moves the gap between two tokens' logits.

The soak's fresh-engine check (gemma_spec_dev/soak/fresh.py) lets a node's answer part from a fresh
engine's text only where the fresh engine's logits of the two tokens are within NEAR_TIE: several
requests at once put a request's KV cells elsewhere and its rows in other batches, and with flash
attention on (the embedded profile) the sums then run in another order. This measures that spread
on the node's own build and model: for each soak reference prompt, the fresh engine's greedy text;
at each of its first positions, the gap between the fresh choice and the runner-up; then the same
context decoded again beside two other sequences of random length (cells taken first), in one batch,
the generated tokens one by one, or one by one in passes with the others' rows (as a node decodes
three requests at once). Prints per prompt the largest move of a gap (fresh gap - gap beside
others, either way) and the overall largest.

    .venv/bin/python scripts/tie_spread.py [--model PATH] [--trials 60] [--positions 8] [--first 0]
        [--prompt INDEX ...] [--beside-max 1900]
"""
from __future__ import annotations

import argparse
import os
import random

import numpy as np

from gemma_spec_dev.soak.scenario import COMPLETION_PROMPTS, REFERENCE_PROMPTS
from gemma_spec_ros.engine.config import ModelConfig
from gemma_spec_ros.engine.llama.model import LlamaModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf")
    parser.add_argument("--trials", type=int, default=60, help="placements beside others per prompt")
    parser.add_argument("--positions", type=int, default=8, help="generated positions looked at per prompt")
    parser.add_argument("--first", type=int, default=0,
                        help="generated positions passed over before the first looked at")
    parser.add_argument("--prompt", type=int, action="append", help="a reference prompt's index (default: all)")
    parser.add_argument("--beside-max", type=int, default=1900, help="longest other sequence (tokens)")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0 = all cores)")
    parser.add_argument("--no-flash-attn", dest="flash_attn", action="store_false")
    args = parser.parse_args()
    model = LlamaModel(ModelConfig(os.path.expanduser(args.model), n_ctx=2048, n_batch=512, n_threads=args.threads,
                                   flash_attn=args.flash_attn), n_seq=3)
    rng = random.Random(1)
    largest = 0.0
    for index, prompt in enumerate(REFERENCE_PROMPTS):
        if args.prompt and index not in args.prompt:
            continue
        context = model.tokenize(prompt)
        prompt_length = len(context) - 1  # the last prompt token is decoded like a generated one
        for _ in range(args.first):  # the fresh engine's greedy text up to the first position looked at
            model.clear()
            row = np.asarray(model.decode(context, [len(context) - 1])[-1])
            context.append(int(np.argmax(row)))
        moves = []
        for _ in range(args.positions):
            model.clear()
            row = np.asarray(model.decode(context, [len(context) - 1])[-1], dtype=np.float64)
            first, second = (int(t) for t in np.argsort(row)[::-1][:2])
            fresh_gap = row[first] - row[second]
            for trial in range(args.trials):
                model.clear()
                for seq in (1, 2):
                    other = model.tokenize(rng.choice(COMPLETION_PROMPTS) * rng.randint(1, 20))
                    other = other[:rng.randint(5, args.beside_max)]
                    model.decode(other, [len(other) - 1], seq=seq)
                if trial % 3 == 0:
                    beside = model.decode(context, [len(context) - 1], seq=0)[-1]
                elif trial % 3 == 1:  # the prompt in one pass, the rest token by token
                    model.decode(context[:prompt_length], [], seq=0)
                    for token in context[prompt_length:]:
                        beside = model.decode([token], [0], seq=0)[-1]
                else:  # the rest token by token, each in a pass with the others' rows
                    model.decode(context[:prompt_length], [], seq=0)
                    for token in context[prompt_length:]:
                        beside = model.decode_parts([(0, [token], [0]), (1, [rng.randint(5, 999)], [0]),
                                                     (2, [rng.randint(5, 999)] * rng.randint(1, 8), [0])])[0][-1]
                moves.append(abs(fresh_gap - (float(beside[first]) - float(beside[second]))))
            if model.is_eog(first):
                break
            context.append(first)
        largest = max(largest, max(moves))
        print(f"{prompt[:40]!r:44} largest move {max(moves):.3f}  median {float(np.median(moves)):.3f}")
    print(f"largest move of a gap beside others: {largest:.3f}")
    model.close()


if __name__ == "__main__":
    main()
