"""Pure functions of the benchmark: repetition figure, output hashes, same-run ratios and their
aggregation. No I/O, no models; the unit tests feed them fixed numbers.

Conventions used throughout the bench:

- **tokens/s** of a run is the decode rate ``(n_tokens - n_first) / (wall - ttft)``: tokens after the
  first emitted chunk over the time after it, so prompt evaluation (the same work for every method)
  does not dilute the ratios. The end-to-end rate ``n_tokens / wall`` is recorded next to it.
- **speedup** of a run is its tokens/s divided by the tokens/s of the reference runner (``off``) on
  the same prompt in the same repeat: machine noise that lasts longer than a few seconds hits both.
- A suite's figure is the **median** of those per-prompt, per-repeat ratios, with their min and max.
"""
from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the output's n-grams that already occurred earlier in the output.

    0.0 for text without any repeated n-gram, close to 1.0 for a loop; 0.0 when the output has
    fewer than ``n`` tokens. It is the figure to read next to an n-gram drafter's acceptance: a model
    that repeats itself makes lookup decoding look good.

    >>> repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4])  # 5 four-grams, (1,2,3,4) seen twice
    0.2
    >>> repeated_ngram_share([7, 7, 7, 7, 7, 7])  # 3 four-grams, all the same
    0.6666666666666666
    """
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    distinct = {tuple(tokens[i:i + n]) for i in range(total)}
    return (total - len(distinct)) / total


def text_hash(text: str) -> str:
    """Short, stable hash of an output text (the same text gives the same hash in every runner)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def tokens_hash(tokens: Sequence[int]) -> str:
    """Short, stable hash of a token id sequence."""
    return hashlib.sha1(",".join(str(int(t)) for t in tokens).encode("ascii")).hexdigest()[:16]


def decode_rate(n_tokens: int, n_first: int, wall_s: float, ttft_s: float) -> float:
    """Tokens/s after the first emitted chunk (NaN when there is nothing after it).

    >>> decode_rate(129, 1, 4.2, 0.2)  # 128 tokens in the 4.0 s after the first one
    32.0
    """
    span = wall_s - ttft_s
    rest = n_tokens - n_first
    if rest <= 0 or span <= 0 or not math.isfinite(span):
        return math.nan
    return rest / span


def finite(value: Optional[float]) -> bool:
    """True for a real, finite number (not None, not NaN, not inf)."""
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Spread:
    """Median with min and max of a set of values (ratios, rates); n = how many went in."""

    median: float
    low: float
    high: float
    n: int

    def format(self, unit: str = "x", digits: int = 2) -> str:
        """'1.52x (1.31-1.70)'; '-' when there is no value."""
        if self.n == 0:
            return "-"
        core = f"{self.median:.{digits}f}{unit}"
        if self.n == 1:
            return core
        return f"{core} ({self.low:.{digits}f}-{self.high:.{digits}f})"

    def as_dict(self) -> Dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


EMPTY_SPREAD = Spread(math.nan, math.nan, math.nan, 0)


def spread(values: Iterable[Optional[float]]) -> Spread:
    """Median, min and max of the finite values (None and NaN are left out).

    >>> spread([1.0, 3.0, None, 2.0, float('nan')])
    Spread(median=2.0, low=1.0, high=3.0, n=3)
    """
    kept = [float(v) for v in values if finite(v)]
    if not kept:
        return EMPTY_SPREAD
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept))


#: A run's position in the interleaved schedule: (suite, prompt id, repeat).
RunKey = Tuple[str, str, int]


def same_run_ratios(rates: Mapping[str, Mapping[RunKey, float]], numerator: str,
                    denominator: str) -> Dict[RunKey, float]:
    """Per (suite, prompt, repeat) ratio ``rates[numerator] / rates[denominator]``.

    Only keys both runners measured (finite, positive denominator) get a ratio: a failed run drops
    out instead of being compared with another repeat's figure.

    >>> r = {"lookup": {("code", "a", 0): 60.0, ("code", "a", 1): 50.0},
    ...      "off": {("code", "a", 0): 30.0, ("code", "a", 1): 40.0, ("code", "b", 0): 35.0}}
    >>> same_run_ratios(r, "lookup", "off")
    {('code', 'a', 0): 2.0, ('code', 'a', 1): 1.25}
    """
    num = rates.get(numerator, {})
    den = rates.get(denominator, {})
    out: Dict[RunKey, float] = {}
    for key, value in num.items():
        base = den.get(key)
        if finite(value) and finite(base) and base > 0:
            out[key] = value / base
    return out


def ratio_by_suite(ratios: Mapping[RunKey, float], suites: Sequence[str]) -> Dict[str, Spread]:
    """Median (min-max) of the same-run ratios per suite, plus ``"all"`` over every suite.

    >>> rs = {("code", "a", 0): 2.0, ("code", "b", 0): 1.0, ("code", "a", 1): 1.5, ("qa", "x", 0): 0.9}
    >>> by = ratio_by_suite(rs, ["code", "qa"])
    >>> by["code"].format(), by["qa"].format(), by["all"].n
    ('1.50x (1.00-2.00)', '0.90x', 4)
    """
    out = {suite: spread(v for (s, _, _), v in ratios.items() if s == suite) for suite in suites}
    out["all"] = spread(ratios.values())
    return out


def ratio_by_prompt(ratios: Mapping[RunKey, float]) -> Dict[Tuple[str, str], Spread]:
    """Median (min-max over repeats) of the same-run ratios of each (suite, prompt)."""
    keys = sorted({(s, p) for (s, p, _) in ratios})
    return {k: spread(v for (s, p, _), v in ratios.items() if (s, p) == k) for k in keys}


def pooled_acceptance(accepted_at: Iterable[Sequence[int]],
                      drafted_at: Iterable[Sequence[int]]) -> List[float]:
    """Acceptance per draft position pooled over runs: sum accepted at i / sum drafted at i.

    Pooling counts (rather than averaging per-run rates) weighs each draft once.

    >>> pooled_acceptance([[2, 1], [1]], [[3, 3], [2]])
    [0.6, 0.3333333333333333]
    """
    acc: List[int] = []
    dra: List[int] = []
    for a_row, d_row in zip(accepted_at, drafted_at):
        for store, row in ((acc, a_row), (dra, d_row)):
            store.extend([0] * (len(row) - len(store)))
            for i, v in enumerate(row):
                store[i] += int(v)
    return [a / d if d else 0.0 for a, d in zip(acc, dra)]


def parity_share(hashes: Mapping[RunKey, str], reference: Mapping[RunKey, str]) -> float:
    """Share of runs whose output hash equals the reference runner's on the same key (NaN if none).

    >>> parity_share({("c", "a", 0): "h1", ("c", "b", 0): "h2"}, {("c", "a", 0): "h1", ("c", "b", 0): "h3"})
    0.5
    """
    common = [k for k in hashes if k in reference and hashes[k] and reference[k]]
    if not common:
        return math.nan
    return sum(hashes[k] == reference[k] for k in common) / len(common)


__all__ = [
    "EMPTY_SPREAD", "RunKey", "Spread", "decode_rate", "finite", "parity_share", "pooled_acceptance",
    "ratio_by_prompt", "ratio_by_suite", "repeated_ngram_share", "same_run_ratios", "spread",
    "text_hash", "tokens_hash",
]
