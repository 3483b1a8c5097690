"""What every drafter is: the base class the engine calls, and the draft it returns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Hashable, Optional, Sequence, Tuple

from ..config import SamplingParams, SpecConfig


if TYPE_CHECKING:  # numpy in annotations only: configs validate without it
    import numpy as np


@dataclass(frozen=True)
class Draft:
    """Tokens a drafter proposes to follow the context. ``()`` = nothing to propose.

    ``probs[i]`` is the draft distribution q over the vocabulary at position i (model drafts, used by
    ``rejection`` verification); None for n-gram drafts, which are deterministic.

    ``evidence[i]``: what token i rests on, a hashable class (n-gram lookup: which cache, how long
    the n-gram, whether its continuation was unanimous); None from drafters that do not say. The
    policy learns acceptance per class and cuts each draft where its expected gain peaks
    (:meth:`~gemma_spec_ros.engine.policy.length.DraftLengthPolicy.cut`).
    """

    tokens: Tuple[int, ...] = ()
    probs: Optional[Tuple["object", ...]] = None  # tuple of numpy float arrays, one per token
    source: str = ""  # the drafter that produced it (its ``name``): "draft" | "lookup"
    evidence: Optional[Tuple[Hashable, ...]] = None

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, keep: int) -> "Draft":
        """This draft cut to its first ``keep`` tokens (the empty draft for none)."""
        if keep >= len(self.tokens):
            return self
        if keep <= 0:
            return EMPTY_DRAFT
        probs = None if self.probs is None else self.probs[:keep]
        evidence = None if self.evidence is None else self.evidence[:keep]
        return Draft(self.tokens[:keep], probs, self.source, evidence)


EMPTY_DRAFT = Draft()


class Drafter:
    """What every drafter is; the engine calls nothing else. A drafter subclasses this and
    implements :meth:`propose`; the other hooks have defaults for a drafter that has nothing to do
    there (no model, nothing learned, nothing saved).

    Per request: ``begin`` once, then per step ``before_target_pass`` and ``propose``, ``end`` once.
    Per engine: ``warm_up`` (calibration), ``take_fault`` (after each request) and ``close``. A
    drafter keeps no acceptance counters: the engine's SpecStats and its per-drafter draft-length
    policy do. A new kind of drafter is registered (:mod:`.registry`) and named in a mode's chain
    (:mod:`..modes`).
    """

    name: str = ""  # the name the mode table's chains use (modes.py) and Draft.source
    #: a probe costs ~nothing (n-gram lookup); a model first catches up on the context
    cheap_to_probe: bool = True
    #: its drafts run no model and carry ``Draft.evidence`` (n-gram lookup): with ``spec.adaptive``
    #: it proposes K tokens at every step and its policy cuts each draft (policy.py); the whole
    #: drafts are checked against the emitted tokens (engine/policy/hindsight.py)
    cuts_drafts: bool = False
    #: (with ``cuts_drafts``) under a grammar too: its draft after the forced text is cut by its
    #: policy, the forced rows counted (engine/propose.py); else its constrained drafts take the
    #: length its policy decides per step
    cuts_constrained_drafts: bool = False
    #: what loading recovered from (e.g. a corrupt cache moved aside), for the owner to log; a
    #: drafter that recovers from nothing keeps this empty tuple
    warnings: Sequence[str] = ()

    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional["np.random.Generator"] = None) -> None:
        """A new request starts with these prompt tokens (per-request state resets here).

        ``sampling`` and ``rng`` are given when the request verifies by rejection sampling: a drafter
        that can, then samples its drafts from that sampler and returns their distributions
        (``Draft.probs``); without them it drafts deterministically (greedy, or by n-gram counts).
        The default keeps no per-request state.
        """
        del prompt_tokens, sampling, rng

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens to follow ``context`` (prompt + all accepted tokens), under the
        limits of ``spec`` (``p_min``, ``draft_min``) in effect at this step."""
        raise NotImplementedError(f"drafter {self.name!r} does not propose")

    def before_target_pass(self, drafting: bool) -> None:
        """The target decodes next (the prompt, or a verify pass); ``drafting``: this drafter is in
        the chain of the step's mode, so it may draft after this pass. A drafter that reads rows
        the target exports (MTP's hidden rows) turns that export on only then: the other modes
        pay nothing for it. The default reads no target rows."""
        del drafting

    def end(self, tokens: Sequence[int]) -> None:
        """The request finished with these tokens (prompt + generated); learn from them. The
        default learns nothing."""
        del tokens

    def take_fault(self) -> Optional[str]:
        """A problem outside any request since the last call (a periodic save failed), reported
        once; never raised into a request. The default has none."""
        return None

    def warm_up(self, filler: Sequence[int], max_rows: int, passes: int) -> None:
        """Run the passes drafting uses, untimed, so that measured draft costs are steady-state
        ones. The default runs no model: nothing to warm up."""
        del filler, max_rows, passes

    def model_info(self) -> Optional[dict]:
        """The model this drafter runs (path, size, ...); the default: None, it runs none."""
        return None

    def status(self) -> Dict[str, Any]:
        """Key-values for /diagnostics (e.g. the learned cache's size); the default: none."""
        return {}

    def for_slot(self, seq: int) -> "Drafter":
        """A drafter of the same kind for another request that runs at the same time, in sequence
        ``seq`` of the target (engine/slots.py): its own per-request state, this drafter's
        learned state and models (it owns nothing that :meth:`close` must free or save). Raises
        ValueError with the reason where this kind cannot draft for several requests at once
        (the default)."""
        raise ValueError(f"the {self.name} drafter drafts for one request at a time")

    def close(self) -> None:
        """Free resources and persist what should survive (dynamic caches); the default holds
        neither."""
