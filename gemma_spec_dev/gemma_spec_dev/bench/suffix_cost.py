"""What the suffix drafter costs with a full history: time per step, per request, to load, and memory.

    python -m gemma_spec_dev.bench.suffix_cost --outputs /tmp/planner_free.json

The history is filled to its cap with the reference outputs of a trace (``bench.trace_replay
--outputs``; repeated as often as it takes), then the trace's requests are replayed against it as
the engine runs them: ``begin`` with the prompt, ``propose`` at every emitted token, ``end``. Reported
(JSON): milliseconds of a ``propose`` (median and 95th percentile), of ``begin`` and ``end``, of
saving and loading the history file, and the Python memory the drafter holds (tracemalloc), at the
cap given. Times are CPU-bound Python: on a shared host run it with ``nice`` and read the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from gemma_spec_ros.engine.drafters.suffix import SuffixConfig, SuffixDrafter


def _ms(samples: Sequence[float]) -> Dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": 1e3 * statistics.median(ordered),
            "p95_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}


def fill(drafter: SuffixDrafter, outputs: Sequence[Sequence[int]], tokens: int) -> None:
    """End requests with these outputs, round after round, until the history holds ``tokens``."""
    while drafter.history_tokens < tokens:
        for out in outputs:
            drafter.begin([])
            drafter.end(list(out))


def measure(texts: Sequence[Dict[str, Any]], history_max_tokens: int, max_draft: int = 12) -> Dict[str, Any]:
    """The figures of the module docstring for a history of ``history_max_tokens`` tokens."""
    tracemalloc.start()
    config = SuffixConfig(history_max_tokens=history_max_tokens)
    drafter = SuffixDrafter(config)
    fill(drafter, [t["out"] for t in texts], history_max_tokens)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    propose: List[float] = []
    begin: List[float] = []
    end: List[float] = []
    for text in texts:
        prompt, out = list(text["prompt"]), list(text["out"])
        started = time.perf_counter()
        drafter.begin(prompt)
        begin.append(time.perf_counter() - started)
        for i in range(1, len(out)):
            started = time.perf_counter()
            drafter.propose(prompt + out[:i], max_draft)
            propose.append(time.perf_counter() - started)
        started = time.perf_counter()
        drafter.end(prompt + out)
        end.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "history.bin"
        saving = SuffixDrafter(SuffixConfig(history_path=str(path), history_max_tokens=history_max_tokens))
        fill(saving, [t["out"] for t in texts], history_max_tokens)
        started = time.perf_counter()
        saving.save()
        saved_s = time.perf_counter() - started
        started = time.perf_counter()
        SuffixDrafter(SuffixConfig(history_path=str(path), history_max_tokens=history_max_tokens))
        loaded_s = time.perf_counter() - started
        size = path.stat().st_size
    return {"history_max_tokens": history_max_tokens, "history_tokens": drafter.history_tokens,
            "levels": list(config.levels), "propose": _ms(propose), "begin": _ms(begin), "end": _ms(end),
            "prompt_tokens_median": statistics.median(len(t["prompt"]) for t in texts),
            "save_ms": 1e3 * saved_s, "load_ms": 1e3 * loaded_s, "file_bytes": size,
            "memory_mib": memory / 2**20, "proposals": len(propose)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", required=True, help="reference outputs of bench.trace_replay")
    parser.add_argument("--caps", default="16384,65536", help="history caps to measure, in tokens")
    args = parser.parse_args(argv)
    texts = json.loads(Path(args.outputs).read_text())["texts"]
    results = [measure(texts, int(cap)) for cap in args.caps.split(",")]
    json.dump(results, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
