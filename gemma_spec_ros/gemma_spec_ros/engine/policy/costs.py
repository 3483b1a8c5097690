"""What passes and drafts cost on this device, measured: the cost model the
draft-length policy predicts with (seeded at load by :mod:`.calibration`)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence


class CostModel:
    """Measured costs on this device (seconds): target passes and drafting.

    A target pass over n rows is predicted as ``shape[n] * level``. Every observed pass, whatever its
    size, moves the common ``level`` (an exponential moving average of observed / predicted): a
    machine that gets busier or a context that grows longer raises the cost of every size alike.
    The ``shape`` of a size moves only with what the level does not explain, and slowly. So the
    ratios V(k+1) / V(1) the policy compares stay consistent: with one moving average per size (the
    earlier model) the sizes in use followed the load while the others kept older, cheaper
    figures, and the policy drifted to the sizes it had not used lately (short drafts on a busy CPU).
    """

    def __init__(self, smoothing: float = 0.1, shape_smoothing: float = 0.005) -> None:
        self.smoothing = smoothing
        self.shape_smoothing = shape_smoothing
        self._verify: Dict[int, float] = {}  # shape: seconds of an n-row pass at level 1
        self._level = 1.0
        self._draft_per_token: Dict[str, float] = {}

    def _ema(self, table: Dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.smoothing * (value - old)

    def observe_verify(self, n_rows: int, seconds: float) -> None:
        """One target pass over ``n_rows`` tokens (all rows asking for logits) took ``seconds``."""
        base = self._verify.get(n_rows)
        if base is None or base <= 0:
            self._verify[n_rows] = seconds / self._level  # a size seen first: its shape at this level
            return
        self._level *= 1.0 + self.smoothing * (seconds / (base * self._level) - 1.0)
        self._verify[n_rows] = base + self.shape_smoothing * (seconds / self._level - base)

    def observe_draft_time(self, source: str, n_tokens: int, seconds: float) -> None:
        """Drafting ``n_tokens`` (>= 1) with ``source`` took ``seconds`` (catch-up included)."""
        if n_tokens > 0:
            self._ema(self._draft_per_token, source, seconds / n_tokens)

    def verify_cost(self, n_rows: int) -> Optional[float]:
        """Predicted cost of an ``n_rows`` pass: the shape, interpolated linearly between measured
        sizes and extrapolated from the two largest beyond them, times the level; None before any
        measurement."""
        shape = self._shape_cost(n_rows)
        return None if shape is None else shape * self._level

    def _shape_cost(self, n_rows: int) -> Optional[float]:
        table = self._verify
        if not table:
            return None
        if n_rows in table:
            return table[n_rows]
        sizes = sorted(table)
        if len(sizes) == 1:
            return table[sizes[0]] * n_rows / sizes[0] if n_rows > sizes[0] else table[sizes[0]]
        lower = [s for s in sizes if s < n_rows]
        upper = [s for s in sizes if s > n_rows]
        if lower and upper:
            lo, hi = lower[-1], upper[0]
        elif upper:  # below the smallest measured size
            return table[sizes[0]]
        else:
            lo, hi = sizes[-2], sizes[-1]
        slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
        return table[lo] + slope * (n_rows - lo)

    def draft_cost(self, source: str, n_tokens: int) -> float:
        return self._draft_per_token.get(source, 0.0) * n_tokens

    def speedups(self, source: str, expected: Sequence[float], *, rows: int = 0, others: float = 0.0,
                 forced: int = 0) -> List[float]:
        """The predicted speedup S(k) over plain decoding of a pass that verifies ``forced`` tokens a
        grammar forces (taken as accepted) and then ``k`` tokens drafted by ``source``, for k = 0 ..
        len(expected) - 1, where ``expected[k]`` is E(k), the tokens a k-token draft is expected to
        emit; the pass also holds ``rows`` rows of other requests expected to emit ``others`` tokens
        (engine/policy/length.py derives the formula). All NaN before any pass was measured.

        >>> costs = CostModel()
        >>> costs.observe_verify(1, 0.026); costs.observe_verify(4, 0.040)
        >>> [round(s, 2) for s in costs.speedups("lookup", [1.0, 1.8, 2.36, 2.70])]
        [1.0, 1.53, 1.74, 1.75]
        """
        plain = self.verify_cost(rows + 1)
        if plain is None:
            return [math.nan] * len(expected)
        per_token = self._draft_per_token.get(source, 0.0)
        return [(forced + e + others) * plain
                / ((1.0 + others) * (per_token * k + self.verify_cost(rows + forced + k + 1)))
                for k, e in enumerate(expected)]

    @property
    def plain_token_time(self) -> float:
        cost = self.verify_cost(1)
        return math.nan if cost is None else cost
