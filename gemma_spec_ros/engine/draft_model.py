"""Drafting with a second, smaller model of the same vocabulary (e.g. Gemma 1B for a 4B target)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .backend import LlamaBackend, check_vocab_compatible
from .sampling import Sampler, _inverse_cdf
from .types import Draft, ModelConfig, SamplingParams

_GREEDY = Sampler(SamplingParams())


def _top_probability(logits: np.ndarray, top: int) -> float:
    """Softmax probability of token ``top`` (the draft's confidence in its greedy choice)."""
    shift = float(logits[top])
    return 1.0 / float(np.exp(logits.astype(np.float64) - shift).sum())


class DraftModelDrafter:
    """Greedy (or, for ``rejection`` verification, sampled) drafting with a small model.

    - KV reuse: the draft model keeps its cache across steps and requests; each ``propose`` keeps
      the longest common prefix with the new context and decodes only the rest (the rollback of
      tokens the target rejected happens here, by that prefix match).
    - ``p_min``: greedy drafting stops when the draft's own top-token probability falls below it
      (llama.cpp's rule), since a low-confidence token is likely to be rejected.
    - ``n_min``: a draft shorter than this is dropped (verification costs a pass anyway).
    """

    name = "draft"

    def __init__(self, config: ModelConfig, target: LlamaBackend, *, p_min: float = 0.75,
                 n_min: int = 0) -> None:
        self.backend = LlamaBackend(config)
        try:
            check_vocab_compatible(target, self.backend)
        except Exception:
            self.backend.close()
            raise
        self.p_min = p_min
        self.n_min = n_min
        self._sampler: Optional[Sampler] = None  # set for stochastic (rejection) drafting
        self._rng: Optional[np.random.Generator] = None
        self.num_drafted = 0
        self.num_accepted = 0

    def set_limits(self, p_min: float, n_min: int) -> None:
        self.p_min, self.n_min = p_min, n_min

    def set_sampling(self, sampler: Optional[Sampler], rng: Optional[np.random.Generator]) -> None:
        """Sample drafts from ``sampler`` (with probabilities, for rejection verification), or
        draft greedily when None."""
        self._sampler = None if sampler is None or sampler.greedy else sampler
        self._rng = rng

    def warm_up(self, filler: Sequence[int], max_rows: int, passes: int) -> None:
        """Run the passes drafting uses (a catch-up batch, one-token steps) untimed, so the first
        measured draft costs are steady-state ones; leaves the KV cache empty."""
        backend = self.backend
        backend.clear()
        backend.decode(list(filler), [len(filler) - 1])
        for _ in range(passes):
            for n in sorted({1, max(1, min(max_rows, len(filler) - 1))}):
                backend.decode(list(filler[1:n + 1]), [n - 1])
                backend.rollback(len(filler))
        backend.clear()

    # -- Drafter protocol -------------------------------------------------------------------------
    def begin(self, prompt_tokens: Sequence[int]) -> None:
        """Nothing to reset: the KV prefix of the previous request is reused if it matches."""

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        backend = self.backend
        room = backend.n_ctx - len(context)
        max_tokens = min(max_tokens, room)
        if max_tokens <= 0:
            return Draft()
        backend.reuse_prefix(context, keep_last=1)
        rows = backend.decode(list(context[backend.n_past:]), [len(context) - backend.n_past - 1])
        logits = rows[0]
        tokens: List[int] = []
        probs: List[np.ndarray] = []
        while True:
            if self._sampler is not None:
                q = self._sampler.distribution(logits)
                token = _inverse_cdf(q, self._rng.random())
                probs.append(q)
            else:
                token = _GREEDY.sample(logits, None)
                if _top_probability(logits, token) < self.p_min:
                    break
            tokens.append(token)
            if len(tokens) >= max_tokens or backend.is_eog(token):
                break
            logits = backend.decode([token], [0])[0]
        if len(tokens) < self.n_min:
            return Draft()
        return Draft(tuple(tokens), tuple(probs) if self._sampler is not None else None, self.name)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafted += num_proposed
        self.num_accepted += num_accepted

    def end(self, tokens: Sequence[int]) -> None:
        """Nothing to learn; the KV cache stays for prefix reuse."""

    def close(self) -> None:
        self.backend.close()
