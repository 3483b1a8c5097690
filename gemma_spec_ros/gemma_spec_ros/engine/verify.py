"""Verification of a draft against the target's logits: two pure, seeded functions.

Glossary (vLLM): **accepted** draft tokens form a prefix of the draft; the target then emits one
more token, **recovered** (its own choice at the first rejected position) or **bonus** (after a
fully accepted draft). So a verify pass over a K-token draft emits between 1 and K+1 tokens.

``rows[i]`` are the target's logits after ``context + draft[:i]``, for i = 0..K (K+1 rows: the
target decoded ``[pending] + draft`` in one batch).

- :func:`verify_exact` samples the target at each row with the request's sampler and accepts while
  the sample equals the draft token. It emits exactly the tokens plain decoding would emit with the
  same random stream (one draw per emitted token), for ANY drafter: lossless and reproducible.
- :func:`verify_rejection` is Leviathan et al. 2023 / Chen et al. 2023: accept x_i with probability
  min(1, p(x_i) / q(x_i)); on rejection sample from norm(max(0, p - q)). The output distribution is
  the target's p; acceptance is higher than ``exact`` when the draft samples from a q close to p.
  For a deterministic (n-gram or greedy) draft, q is a point mass on x_i.

Under a grammar (``grammar``: the request's :class:`~.grammar.Grammar`, advanced here over every
emitted token) each row is sampled as plain constrained decoding samples it: under the grammar state
the tokens before it reached (:func:`~.grammar.sample_constrained`); rejection verification compares
the draft with that row's constrained distribution (:func:`~.grammar.constrained_distribution`).

Worked example (greedy, so sampling = argmax): draft (7, 3, 9); row argmaxes (7, 3, 4, 2) ->
accept 7 and 3, reject 9, recovered token 4: emitted (7, 3, 4), num_accepted 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from .grammar.matcher import Grammar, constrained_distribution, sample_constrained
from .sampling import Sampler, inverse_cdf


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verify pass."""

    tokens: Tuple[int, ...]  # accepted draft prefix + the recovered or bonus token
    num_accepted: int  # how many draft tokens were accepted (len(tokens) - 1)


def verify_exact(rows: Sequence[np.ndarray], draft: Sequence[int], sampler: Sampler,
                 rng: np.random.Generator, grammar: Optional[Grammar] = None) -> Verdict:
    """Accept while the target's own sample equals the draft token.

    >>> rows = [np.eye(10, dtype=np.float32)[t] for t in (7, 3, 4, 2)]
    >>> from .sampling import make_rng
    >>> from .config import SamplingParams
    >>> verify_exact(rows, (7, 3, 9), Sampler(SamplingParams()), make_rng(0))
    Verdict(tokens=(7, 3, 4), num_accepted=2)
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"{len(rows)} logit rows for a {len(draft)}-token draft (need K+1)")
    emitted = []
    for i, row in enumerate(rows):
        if grammar is None:
            token = sampler.sample(row, rng)
        else:
            token = sample_constrained(lambda r: sampler.sample(r, rng), row, grammar, sampler.greedy)
            grammar.accept(token)
        emitted.append(token)
        if i == len(draft) or token != draft[i]:
            return Verdict(tuple(emitted), i)
    raise AssertionError("unreachable")  # pragma: no cover


def verify_rejection(rows: Sequence[np.ndarray], draft: Sequence[int],
                     draft_probs: Optional[Sequence[Optional[np.ndarray]]], sampler: Sampler,
                     rng: np.random.Generator, grammar: Optional[Grammar] = None) -> Verdict:
    """Speculative sampling: accept x_i w.p. min(1, p(x_i)/q(x_i)), else sample norm(max(0, p-q)).

    ``draft_probs[i]`` is the dense distribution q the drafter sampled x_i from; None means each x_i
    was chosen deterministically (q = point mass), as does a None entry (a token a grammar forced).
    p is the target's distribution after the
    request's temperature / top-k / top-p / min-p, the same one plain decoding samples from.
    A q over fewer ids than p (a draft vocabulary of another size) is 0 on the ids it lacks; ids
    past p's vocabulary have p = 0 and cannot be drafted.
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"{len(rows)} logit rows for a {len(draft)}-token draft (need K+1)")
    if draft_probs is not None and len(draft_probs) != len(draft):
        raise ValueError(f"{len(draft_probs)} draft distributions for a {len(draft)}-token draft")
    emitted = []
    for i, token in enumerate(draft):
        if grammar is None:
            p = sampler.distribution(rows[i])
        else:
            p = constrained_distribution(sampler.distribution, rows[i], grammar)
        q = draft_probs[i] if draft_probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        if q_token > 0.0 and rng.random() * q_token < p[token]:
            emitted.append(token)
            if grammar is not None:
                grammar.accept(token)
            continue
        if q is not None:
            residual = np.maximum(p - _aligned(q, len(p)), 0.0)
        else:
            residual = p.copy()
            residual[token] = 0.0
        if residual.sum() <= 0.0:  # p == q up to rounding: any sample of p is right
            residual = p
        emitted.append(inverse_cdf(residual, rng.random()))
        if grammar is not None:
            grammar.accept(emitted[-1])
        return Verdict(tuple(emitted), i)
    verdict = verify_exact(rows[len(draft):], (), sampler, rng, grammar)  # the bonus token
    return Verdict(tuple(emitted) + verdict.tokens, len(draft))


def _aligned(q: np.ndarray, n_vocab: int) -> np.ndarray:
    """``q`` over exactly ``n_vocab`` ids: cut, or padded with zeros (ids the draft lacks)."""
    if len(q) == n_vocab:
        return q
    if len(q) > n_vocab:
        return q[:n_vocab]
    return np.concatenate([q, np.zeros(n_vocab - len(q), dtype=q.dtype)])
