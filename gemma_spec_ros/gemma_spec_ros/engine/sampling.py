"""Choosing tokens: sampling one row of logits, and verifying a draft against a target pass's rows.

**Sampling** (:class:`Sampler`): greedy, or temperature + top-k + top-p + min-p, seeded. One uniform
draw per sampled token (inverse CDF over the filtered distribution), so a request that emits the
same tokens consumes the same random numbers whether or not it speculates: that is what makes
``exact`` verification reproduce plain decoding token for token under a seed. Under a grammar a row
is sampled with the tokens the grammar refuses at -inf (:func:`sample_constrained`).

**Verification** (vLLM's glossary): **accepted** draft tokens form a prefix of the draft; the target
then emits one more token, **recovered** (its own choice at the first rejected position) or
**bonus** (after a fully accepted draft). So a verify pass over a K-token draft emits between 1 and
K+1 tokens. ``rows[i]`` are the target's logits after ``context + draft[:i]``, for i = 0..K (K+1
rows: the target decoded ``[pending] + draft`` in one batch).

- :func:`verify_exact` samples the target at each row with the request's sampler and accepts while
  the sample equals the draft token. It emits exactly the tokens plain decoding would emit with the
  same random stream (one draw per emitted token), for ANY drafter: lossless and reproducible.
- :func:`verify_rejection` is Leviathan et al. 2023 / Chen et al. 2023: accept x_i with probability
  min(1, p(x_i) / q(x_i)); on rejection sample from norm(max(0, p - q)). The output distribution is
  the target's p; acceptance is higher than ``exact`` when the draft samples from a q close to p.
  For a deterministic (n-gram or greedy) draft, q is a point mass on x_i.

Under a grammar (``masks``: one per row, what the grammar allows there, as llguidance's bitmask,
from :meth:`~.grammar.matcher.Grammar.row_masks`; the caller then advances the grammar over the emitted
tokens) each row is sampled as plain constrained decoding samples it: under the grammar state the
tokens before it reached (:func:`sample_constrained`); rejection verification compares the draft
with that row's constrained distribution (:func:`constrained_distribution`). A row the grammar
decides (its draft token is the one allowed) comes without logits nor a mask: its token is taken.

Worked example (greedy, so sampling = argmax): draft (7, 3, 9); row argmaxes (7, 3, 4, 2) ->
accept 7 and 3, reject 9, recovered token 4: emitted (7, 3, 4), num_accepted 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .config import SamplingParams
from .errors import DEAD_END, GrammarError

# Nucleus search starts from this many top candidates and falls back to a full sort only when
# their mass is below top_p (a full argsort of 262k logits costs ~15 ms; argpartition ~2 ms).
_NUCLEUS_CANDIDATES = 1024


def make_rng(seed: int) -> np.random.Generator:
    """The request's random generator; seed -1 draws fresh entropy."""
    return np.random.default_rng(None if seed < 0 else seed)


def draft_stream(rng: np.random.Generator) -> np.random.Generator:
    """The first child stream of ``rng``'s seed: what numpy >= 1.25's ``rng.spawn(1)[0]`` returns,
    built from the ``SeedSequence`` numpy 1.17+ keeps in every bit generator, because Ubuntu 22.04
    (ROS 2 Humble, JetPack 6) ships numpy 1.21, whose Generator has no ``spawn``. The child depends
    on the seed alone, so a seeded request's drafts are the same at every run.

    >>> draws = draft_stream(np.random.default_rng(7)).random(3)
    >>> bool((draws == draft_stream(np.random.default_rng(7)).random(3)).all())
    True
    >>> bool((draws == np.random.default_rng(7).random(3)).any())  # not the parent's stream
    False
    """
    bit_generator = rng.bit_generator
    # public as ``seed_seq`` from numpy 1.25; the same object is ``_seed_seq`` since 1.17
    seeds = getattr(bit_generator, "seed_seq", None) or bit_generator._seed_seq
    return np.random.Generator(type(bit_generator)(seeds.spawn(1)[0]))


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

    def take(self, token: int, rng: np.random.Generator) -> int:
        """``token``, where a grammar allows it alone: what :meth:`sample` returns for a row with
        every other token at -inf, drawing what it draws (one random number unless greedy), so
        the random stream stays that of plain decoding."""
        if not self.greedy:
            rng.random()
        return token

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


# -- under a grammar ------------------------------------------------------------------------------
def token_allowed(mask: np.ndarray, token: int) -> bool:
    """Whether ``mask`` (a grammar's mask over the vocabulary, llguidance's layout: bit t of 32-bit
    word t // 32) allows ``token``."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def allowed_tokens(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """``mask`` as a boolean array over the vocabulary's ``n_vocab`` tokens."""
    unpacked = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return unpacked[:n_vocab].view(np.bool_)


def masked(row: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``row`` (logits over the vocabulary) with the tokens ``mask`` refuses at -inf; GrammarError
    where it allows none."""
    allowed = allowed_tokens(mask, row.shape[0])
    if not allowed.any():
        raise GrammarError(DEAD_END)
    return np.where(allowed, row, np.float32(-np.inf))


def sample_constrained(sample: Callable[[np.ndarray], int], row: np.ndarray, mask: np.ndarray,
                       greedy: bool = False) -> int:
    """One token of ``row`` under a grammar (``mask``: the tokens it allows there): a sample of the
    row with the others at -inf (greedy: the argmax, unmasked where the grammar allows it, which is
    the same, and the row is not copied).

    ``sample`` is the request's sampler bound to its random stream, so that plain decoding and
    every speculative mode draw the same numbers for the same rows."""
    if greedy:
        best = int(row.argmax())
        if token_allowed(mask, best):
            return best
    return sample(masked(row, mask))


def constrained_distribution(distribution: Callable[[np.ndarray], np.ndarray], row: np.ndarray,
                             mask: np.ndarray) -> np.ndarray:
    """The distribution :func:`sample_constrained` draws a token of ``row`` from (for rejection
    verification): the request's distribution of the masked row."""
    return distribution(masked(row, mask))


# -- verification --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """Outcome of one verify pass."""

    tokens: Tuple[int, ...]  # accepted draft prefix + the recovered or bonus token
    num_accepted: int  # how many draft tokens were accepted (len(tokens) - 1)


def verify_exact(rows: Sequence[Optional[np.ndarray]], draft: Sequence[int], sampler: Sampler,
                 rng: np.random.Generator, masks: Optional[Sequence[Optional[np.ndarray]]] = None) -> Verdict:
    """Accept while the target's own sample equals the draft token.

    Under a grammar, ``masks[i]`` is what it allows at row i; a row may be None where the grammar
    allows the draft's token alone (the pass computed no logits there, and its mask is None):
    that token is the row's sample.

    >>> rows = [np.eye(10, dtype=np.float32)[t] for t in (7, 3, 4, 2)]
    >>> verify_exact(rows, (7, 3, 9), Sampler(SamplingParams()), make_rng(0))
    Verdict(tokens=(7, 3, 4), num_accepted=2)
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"{len(rows)} logit rows for a {len(draft)}-token draft (need K+1)")
    emitted = []
    for i, row in enumerate(rows):
        if row is None:  # the grammar's one choice, which is the draft's token
            token = sampler.take(draft[i], rng)
        elif masks is None:
            token = sampler.sample(row, rng)
        else:
            token = sample_constrained(lambda r: sampler.sample(r, rng), row, masks[i], sampler.greedy)
        emitted.append(token)
        if i == len(draft) or token != draft[i]:
            return Verdict(tuple(emitted), i)
    raise AssertionError("unreachable")  # pragma: no cover


def verify_rejection(rows: Sequence[Optional[np.ndarray]], draft: Sequence[int],
                     draft_probs: Optional[Sequence[Optional[np.ndarray]]], sampler: Sampler,
                     rng: np.random.Generator, masks: Optional[Sequence[Optional[np.ndarray]]] = None) -> Verdict:
    """Speculative sampling: accept x_i w.p. min(1, p(x_i)/q(x_i)), else sample norm(max(0, p-q)).

    ``draft_probs[i]`` is the dense distribution q the drafter sampled x_i from; None means each x_i
    was chosen deterministically (q = point mass), as does a None entry (a token a grammar forced).
    p is the target's distribution after the
    request's temperature / top-k / top-p / min-p, the same one plain decoding samples from.
    A q over fewer ids than p (a draft vocabulary of another size) is 0 on the ids it lacks; ids
    past p's vocabulary have p = 0 and cannot be drafted. Under a grammar p is the distribution of
    the row masked by ``masks[i]``; a row may be None where the grammar allows the draft's token
    alone: p is a point mass on it, accepted, with the one random number the test (or the
    residual's sample, where q is 0 there) draws.
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"{len(rows)} logit rows for a {len(draft)}-token draft (need K+1)")
    if draft_probs is not None and len(draft_probs) != len(draft):
        raise ValueError(f"{len(draft_probs)} draft distributions for a {len(draft)}-token draft")
    emitted = []
    for i, token in enumerate(draft):
        if rows[i] is None:  # the grammar's one choice: p(token) = 1
            rng.random()
            emitted.append(token)
            continue
        if masks is None:
            p = sampler.distribution(rows[i])
        else:
            p = constrained_distribution(sampler.distribution, rows[i], masks[i])
        q = draft_probs[i] if draft_probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        if q_token > 0.0 and rng.random() * q_token < p[token]:
            emitted.append(token)
            continue
        if q is not None:
            residual = np.maximum(p - _aligned(q, len(p)), 0.0)
        else:
            residual = p.copy()
            residual[token] = 0.0
        if residual.sum() <= 0.0:  # p == q up to rounding: any sample of p is right
            residual = p
        emitted.append(inverse_cdf(residual, rng.random()))
        return Verdict(tuple(emitted), i)
    bonus = None if masks is None else masks[len(draft):]
    verdict = verify_exact(rows[len(draft):], (), sampler, rng, bonus)  # the bonus token
    return Verdict(tuple(emitted) + verdict.tokens, len(draft))


def _aligned(q: np.ndarray, n_vocab: int) -> np.ndarray:
    """``q`` over exactly ``n_vocab`` ids: cut, or padded with zeros (ids the draft lacks)."""
    if len(q) == n_vocab:
        return q
    if len(q) > n_vocab:
        return q[:n_vocab]
    return np.concatenate([q, np.zeros(n_vocab - len(q), dtype=q.dtype)])
