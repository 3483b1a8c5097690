"""Drafting with a second, smaller model of the same vocabulary (e.g. Gemma 1B for a 4B target)."""
from __future__ import annotations

import threading
from typing import List, Optional, Sequence

import numpy as np

from ..llama.model import LlamaModel
from ..llama.vocab import check_vocab_compatible
from ..sampling import Sampler, inverse_cdf
from .base import Draft, Drafter
from ..config import EngineConfig, ModelConfig, SamplingParams, SpecConfig

_SCRATCH = threading.local()  # per thread: two engines may draft at once in one process


def _top_probability(logits: np.ndarray, top: int, out: Optional[np.ndarray] = None) -> float:
    """Softmax probability of token ``top`` (the draft's confidence in its greedy choice).

    In float32, into ``out`` (a float32 array of the logits' shape that may be overwritten: the
    logits themselves when they are a copy) or a buffer kept per thread: a draft step of a 262k
    vocabulary spent ~400 us here in float64 with a fresh array, ~215 us now (measured on this
    CPU; the exponentials are <= 1 and numpy sums pairwise, so float32 is far finer than the p_min
    threshold needs). ``np.add.reduce`` is what ``ndarray.sum`` calls, without its Python layer."""
    if out is None:
        out = getattr(_SCRATCH, "array", None)
        if out is None or out.shape != logits.shape:
            out = _SCRATCH.array = np.empty(logits.shape, dtype=np.float32)
    np.subtract(logits, logits[top], out=out)
    return 1.0 / float(np.add.reduce(np.exp(out, out=out)))


def greedy_draft_token(logits: np.ndarray, p_min: float, out: Optional[np.ndarray] = None) -> Optional[int]:
    """The most likely token of ``logits``, None when its probability is below ``p_min`` (the
    draft stops there: it would likely be rejected). ``out``: see :func:`_top_probability`."""
    token = int(logits.argmax())  # the method: np.argmax's dispatch costs as much on a small row
    if p_min > 0.0 and _top_probability(logits, token, out) < p_min:
        return None
    return token


def next_draft_token(logits: np.ndarray, sampler: Optional[Sampler], rng: Optional[np.random.Generator],
                     p_min: float, probs: List[np.ndarray]) -> Optional[int]:
    """One drafted token from a drafter model's logits: sampled from ``sampler`` (its distribution q
    appended to ``probs``, for rejection verification), or greedy (:func:`greedy_draft_token`)."""
    if sampler is not None:
        q = sampler.distribution(logits)
        probs.append(q)
        return inverse_cdf(q, rng.random())
    return greedy_draft_token(logits, p_min)


class DraftModelDrafter(Drafter):
    """Greedy (or, for ``rejection`` verification, sampled) drafting with a small model.

    Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`.

    - KV reuse: the draft model keeps its cache across steps and requests; each ``propose`` keeps
      the longest common prefix with the new context and decodes only the rest (the rollback of
      tokens the target rejected happens here, by that prefix match).
    - ``spec.p_min``: greedy drafting stops when the draft's own top-token probability falls below
      it (llama.cpp's rule), since a low-confidence token is likely to be rejected.
    - ``spec.draft_min``: a draft shorter than this is dropped (verification costs a pass anyway).
    - Vocabularies of different sizes (llama.cpp allows 128 tokens apart): drafts use only the
      ids both models have, and a draft distribution covers those ids only; a context holding an
      id the draft lacks (a larger target) gets no draft.
    """

    name = "draft"
    cheap_to_probe = False  # a probe first decodes every context token the model has not seen

    def __init__(self, config: ModelConfig, target: LlamaModel, n_seq: int = 1) -> None:
        #: the draft model; with ``n_seq`` > 1 one sequence per request running at once (for_slot)
        self.model = LlamaModel(config, n_seq=n_seq)
        try:
            check_vocab_compatible(target, self.model)
        except Exception:
            self.model.close()
            raise
        #: the KV sequence this drafter's requests draft in: the model's only one, or its first
        self.backend = self.model if n_seq == 1 else self.model.sequence(0)
        # llama.cpp allows vocabularies up to 128 tokens apart: draft only ids both models have
        self._n_shared = min(target.n_vocab, self.model.n_vocab)
        self._sampler: Optional[Sampler] = None  # set for stochastic (rejection) drafting
        self._rng: Optional[np.random.Generator] = None
        self._owns_model = True

    # -- Drafter (nothing to learn at a request's end: the KV cache stays for prefix reuse) ----------
    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional[np.random.Generator] = None) -> None:
        """Sample this request's drafts from ``sampling`` (with their probabilities, for rejection
        verification), or draft greedily when it is None or greedy. The KV prefix of the previous
        request is reused if it matches."""
        self._sampler = None if sampling is None or sampling.greedy else Sampler(sampling)
        self._rng = rng

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        backend = self.backend
        room = backend.n_ctx - len(context)
        max_tokens = min(max_tokens, room)
        if max_tokens <= 0:
            return Draft()
        backend.reuse_prefix(context, keep_last=1)
        new_tokens = list(context[backend.n_past:])
        if max(new_tokens) >= self.model.n_vocab:  # the target emitted an id the draft lacks
            return Draft()
        rows = backend.decode(new_tokens, [len(context) - backend.n_past - 1])
        n_shared = self._n_shared
        logits = rows[0][:n_shared]
        tokens: List[int] = []
        probs: List[np.ndarray] = []
        while True:
            token = next_draft_token(logits, self._sampler, self._rng, spec.p_min, probs)
            if token is None:
                break
            tokens.append(token)
            if len(tokens) >= max_tokens or self.model.is_eog(token):
                break
            logits = backend.decode([token], [0])[0][:n_shared]
        if len(tokens) < spec.draft_min:
            return Draft()
        return Draft(tuple(tokens), tuple(probs) if self._sampler is not None else None, self.name)

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

    def model_info(self) -> Optional[dict]:
        return self.model.model_info()

    def for_slot(self, seq: int) -> "DraftModelDrafter":
        """A drafter of the same draft model in its sequence ``seq`` (the model was loaded with a
        sequence per request running at once); the model stays this drafter's to free."""
        other = DraftModelDrafter.__new__(DraftModelDrafter)
        other.model, other.backend = self.model, self.model.sequence(seq)
        other._n_shared, other._sampler, other._rng = self._n_shared, None, None
        other._owns_model = False
        return other

    def close(self) -> None:
        if self._owns_model:
            self.model.close()


def build(config: EngineConfig, target: LlamaModel, n_seq: int) -> "DraftModelDrafter":
    """The kind's builder (``engine/drafter_kinds.py``): the standalone draft model of ``draft.model_path``."""
    return DraftModelDrafter(config.draft, target, n_seq)
