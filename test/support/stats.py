"""Statistics for the tests of sampled output: a goodness-of-fit p-value without scipy."""
from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike


def chi_square_p_value(counts: ArrayLike, probs: ArrayLike) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularized gamma (no scipy needed)."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token with probability 0 was sampled"
    stat = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    return _chi2_sf(stat, dof)


def _chi2_sf(x: float, k: int) -> float:
    # survival function of chi-square(k) = Q(k/2, x/2), by the series of the lower gamma
    a, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-15 * total and n < 10000:
        term *= z / (a + n)
        total += term
        n += 1
    lower = math.exp(-z + a * math.log(z) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)
