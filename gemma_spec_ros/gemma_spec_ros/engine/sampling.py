"""Sampling from one row of logits: greedy, or temperature + top-k + top-p + min-p, seeded.

One uniform draw per sampled token (inverse CDF over the filtered distribution), so a request
that emits the same tokens consumes the same random numbers whether or not it speculates: that is
what makes ``exact`` verification reproduce plain decoding token for token under a seed.
"""
from __future__ import annotations

import numpy as np

from .config import SamplingParams

# Nucleus search starts from this many top candidates and falls back to a full sort only when
# their mass is below top_p (a full argsort of 262k logits costs ~15 ms; argpartition ~2 ms).
_NUCLEUS_CANDIDATES = 1024


def make_rng(seed: int) -> np.random.Generator:
    """The request's random generator; seed -1 draws fresh entropy."""
    return np.random.default_rng(None if seed < 0 else seed)


class Sampler:
    """Turns a logits row into the distribution the request samples from, and samples it.

    >>> s = Sampler(SamplingParams(temperature=0.0))
    >>> s.sample(np.array([0.1, 2.0, -1.0], dtype=np.float32), make_rng(0))
    1
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.greedy = params.greedy

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """Dense probabilities (float64, sums to 1) after temperature, top-k, top-p and min-p.

        Greedy is the limit T -> 0: a point mass on the argmax.
        """
        n = logits.shape[0]
        if self.greedy:
            dense = np.zeros(n, dtype=np.float64)
            dense[int(np.argmax(logits))] = 1.0
            return dense
        ids, probs = self._candidates(logits)
        dense = np.zeros(n, dtype=np.float64)
        dense[ids] = probs
        return dense

    def sample(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token from ``logits``; greedy takes no random number."""
        if self.greedy:
            return int(logits.argmax())  # the method: np.argmax's dispatch costs as much on a small row
        ids, probs = self._candidates(logits)
        return int(ids[inverse_cdf(probs, rng.random())])

    def _candidates(self, logits: np.ndarray):
        """(token ids, probabilities) of the tokens that survive filtering.

        Order of filters as llama.cpp's sampler chain: top-k, then top-p over what top-k kept
        (renormalised), then min-p relative to the most likely token.
        """
        p = self.params
        # shifted by the max first: a tiny (even denormal) temperature then gives -inf for the
        # others, never inf - inf = NaN
        scaled = logits.astype(np.float64)  # a copy: scaled in place, no further 262k-row arrays
        scaled -= scaled.max()
        with np.errstate(over="ignore"):  # -inf is the intended result of such an overflow
            scaled /= p.temperature
        n = scaled.shape[0]
        if 0 < p.top_k < n:
            ids = _top_ids(scaled, p.top_k)
            probs = _softmax_of_subset(scaled, ids, renormalise=True)
        elif p.top_p < 1.0:
            ids = _top_ids(scaled, min(_NUCLEUS_CANDIDATES, n))
            probs = _softmax_of_subset(scaled, ids)
            if probs.sum() < p.top_p:  # mass beyond the candidates matters: sort them all
                ids = _top_ids(scaled, n)
                probs = _softmax_of_subset(scaled, ids)
        else:
            ids = np.arange(n)
            weights = np.exp(scaled - scaled.max())
            probs = weights / weights.sum()
        if p.top_p < 1.0:  # ids are sorted most likely first on this path
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
            ids, probs = ids[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs.max()
            ids, probs = ids[keep], probs[keep]
        return ids, probs / probs.sum()


def _top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first; ties broken by lower index (stable)."""
    if k >= values.shape[0]:
        return np.argsort(-values, kind="stable")
    part = np.argpartition(-values, k - 1)[:k]
    order = np.lexsort((part, -values[part]))
    return part[order]


def _softmax_of_subset(scaled: np.ndarray, ids: np.ndarray, renormalise: bool = False) -> np.ndarray:
    """Softmax probabilities of ``ids`` under the full distribution (or renormalised over ids)."""
    top = scaled[ids]
    shift = top[0]
    weights = np.exp(top - shift)
    if renormalise:
        return weights / weights.sum()
    total = np.exp(scaled - shift).sum()
    return weights / total


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The index where ``u`` in [0, 1) falls in the cumulative (unnormalised) ``probs``: one draw.

    >>> inverse_cdf(np.array([0.2, 0.5, 0.3]), 0.1), inverse_cdf(np.array([0.2, 0.5, 0.3]), 0.75)
    (0, 2)
    """
    index = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))
    return min(index, probs.shape[0] - 1)
