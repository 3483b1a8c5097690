"""What a verify row's logits cost on this device: one target pass over ``--rows`` tokens with every
row's logits, with a few rows' logits, with the last row's only, and a pass of one row (docs/benchmarks.md,
"Constrained output": a row whose token the grammar allows alone asks for none).

    .venv/bin/python scripts/logit_rows_cost.py [--model GGUF] [--rows 12] [--rounds 6]

The same context is decoded once; every pass after it is rolled back, so each measures the same
positions. Prints the median milliseconds of each kind and the cost of a row with and without its
logits (the slope between the one-row pass and the others).
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Dict, List, Sequence

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_dev.bench.config import default_params, engine_config

CONTEXT = "The robot plans its next steps in the warehouse. " * 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="GGUF (default: the embedded config's target)")
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passes", type=int, default=8, help="passes of each kind per round")
    args = parser.parse_args()
    config = engine_config(default_params(), "off", None).target
    model = LlamaModel(replace(config, path=args.model) if args.model else config)
    try:
        context = model.tokenize(CONTEXT, add_special=True, parse_special=False)
        model.decode(context, [len(context) - 1])
        n = args.rows
        batch = (context * 2)[5:5 + n]
        every, last = f"{n} rows, every row's logits", f"{n} rows, the last row's logits"
        kinds: Dict[str, Sequence[int]] = {
            every: range(n),
            f"{n} rows, every third row's logits": list(range(n - 1, -1, -3))[::-1],
            last: range(n - 1, n),
        }
        seconds: Dict[str, List[float]] = {name: [] for name in [*kinds, "1 row"]}
        for _ in range(args.rounds):  # the kinds interleaved, round by round
            for name, rows in kinds.items():
                for _ in range(args.passes):
                    seconds[name].append(model.timed_decode(batch, rows)[1])
                    model.rollback(len(context))
            for _ in range(args.passes):
                seconds["1 row"].append(model.timed_decode(batch[:1], range(1))[1])
                model.rollback(len(context))
    finally:
        model.close()
    ms = {name: 1e3 * statistics.median(values) for name, values in seconds.items()}
    for name, value in ms.items():
        print(f"{name}: {value:.2f} ms")
    with_logits, without, one = ms[every], ms[last], ms["1 row"]
    print(f"a row without its logits: {(without - one) / (n - 1):.2f} ms; with them: "
          f"{(with_logits - one) / (n - 1):.2f} ms ({(without - one) / (with_logits - one):.2f} of it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
