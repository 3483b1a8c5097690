"""results.json as written: strict JSON (no NaN), floats rounded, one line per run."""
from __future__ import annotations

import json
import math
from typing import Any, Mapping


def json_ready(value: Any, digits: int = 6) -> Any:
    """NaN and inf to None and floats to ``digits`` significant digits, recursively: strict,
    compact JSON (timings are not meaningful past a few digits).

    >>> json_ready({"a": [float("nan"), 1.23456789, 2]})
    {'a': [None, 1.23457, 2]}
    """
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v, digits) for v in value]
    return value


def dump_results(results: Mapping[str, Any]) -> str:
    """results.json text: the head indented, then one line per run (small, and diffs read well)."""
    clean = json_ready(dict(results))
    runs = clean.pop("runs", [])
    head = json.dumps(clean, indent=1, allow_nan=False)
    lines = ",\n".join("  " + json.dumps(r, separators=(",", ":"), allow_nan=False) for r in runs)
    return head[:-2] + ',\n "runs": [\n' + lines + "\n ]\n}\n"
