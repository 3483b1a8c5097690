"""Which drafter drafts a step: the order a step tries the drafters of its mode in (modes.py), and
the draft one verify pass checks (under a grammar: the text it forces first, then a drafter's
continuation, cut before the first token the grammar refuses)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .grammar.matcher import Grammar
from .policy.length import PLAIN_STEP, SOLO, Decision, DraftLengthPolicy, PassShare
from .policy.costs import CostModel
from .drafters.base import EMPTY_DRAFT, Draft, Drafter
from .config import SpecConfig
from .modes import MODES


#: Draft.source of a draft the grammar forced whole (no drafter continued it)
GRAMMAR_SOURCE = "grammar"
#: Most tokens of forced text one step drafts, whatever K (see :func:`propose`).
GRAMMAR_DRAFT_MAX = 12
#: Under a grammar a drafter's draft may run to max(K, GRAMMAR_K): constrained text is the most
#: predictable there is. Planner suite, constrained, 4 prompts x 2, same run (docs/benchmarks.md):
#: lookup at K 4 with forced text capped at 4 / 12 tokens 1.34x / 1.44x constrained off; K 8 with
#: 12: 1.60x. Unconstrained requests keep K (there an adaptive cap of 8 measured 1.45x against
#: 1.56x at 4 over the suites).
GRAMMAR_K = 8


@dataclass
class Drafting:
    """One drafter with its draft-length policy (acceptance is measured per drafter)."""

    drafter: Drafter
    policy: DraftLengthPolicy


@dataclass(frozen=True)
class DraftRequest:
    """What one step asks of its drafters."""

    mode: str  # the mode in effect at this step (the request's, or the engine's)
    spec: SpecConfig  # the speculation settings in effect at this step
    context: Sequence[int]  # what the target has decoded + the pending token
    k_cap: int  # the most drafted tokens this step (K, less what the request or context has left)
    #: the most tokens a grammar may force this step (they may exceed ``k_cap``: they cost no drafting)
    forced_cap: int = 0
    grammar: Optional[Grammar] = None  # the request's constraint, in the state the context reached
    #: a drafter that cuts its drafts proposes ``k_cap`` tokens and its policy cuts them (adaptive or
    #: ``auto``; under a grammar, only one that cuts its constrained drafts too:
    #: Drafter.cuts_constrained_drafts); the whole draft comes back in Proposal.whole
    cut: bool = False
    share: PassShare = SOLO  # what else the target pass holds (several requests at once)


@dataclass(frozen=True)
class Proposal:
    """The draft a step verifies, with its policy's decision, and how many of its first tokens the
    grammar forced (0 without a grammar). Under a grammar, ``masks`` are the verify pass's rows'
    masks (Grammar.row_masks: None for a row the grammar decides) and ``n_cut`` the drafted tokens
    it refused; ``wholes`` are the drafts a policy cut, as their drafters proposed them (for
    hindsight: the tokens past a cut are never verified), each after the forced text."""

    draft: Draft
    decision: Decision
    n_forced: int = 0
    masks: Optional[List[Optional[np.ndarray]]] = None
    n_cut: int = 0
    wholes: Tuple[Draft, ...] = ()


NO_PROPOSAL = Proposal(EMPTY_DRAFT, PLAIN_STEP)


def drafting_order(mode: str, drafters: Dict[str, Drafting], k_cap: int, adaptive: bool, cut: bool = False,
                   constrained: bool = False, share: PassShare = SOLO) -> Iterator[Tuple[Drafting, Decision, bool]]:
    """The drafters one step tries, in order, each with its policy's decision (draft length > 0) and
    whether that drafter drafts the whole ``k_cap`` for its policy to cut afterwards.

    A mode's chain (modes.py) is tried in table order and honours ``adaptive``
    (``spec.adaptive``); a policy is asked only when its drafter's turn comes. A ``ranked`` mode
    (``auto``) is always adaptive: it asks every policy first and tries the best predicted speedup
    first (not measured yet counts as best; ties keep table order), or drafts nothing.

    ``cut``: an adaptive drafter that cuts its own drafts is always tried, with the whole
    ``k_cap``; its policy cuts the draft afterwards (:func:`propose`). ``constrained`` (a grammar):
    only a drafter that also cuts its constrained drafts does (``Drafter.cuts_constrained_drafts``).
    """
    row = MODES[mode]
    adaptive = adaptive or row.ranked
    decided = (_decide(drafters[name], k_cap, adaptive, cut, constrained, share)
               for name in row.chain if name in drafters)
    if row.ranked:
        decided = iter(sorted(decided, key=lambda chosen: -_rank(chosen[1].predicted_speedup)))
    return (chosen for chosen in decided if chosen[1].draft_len > 0)


def _decide(drafting: Drafting, k_cap: int, adaptive: bool, cut: bool, constrained: bool,
            share: PassShare) -> Tuple[Drafting, Decision, bool]:
    drafter = drafting.drafter
    if cut and adaptive and drafter.cuts_drafts and (not constrained or drafter.cuts_constrained_drafts):
        # ranked in auto by what its verified drafts have shown (the policy's S at its best k)
        return drafting, Decision(k_cap, drafting.policy.best(k_cap, share).predicted_speedup), True
    return drafting, drafting.policy.decide(k_cap, adaptive, share), False


def _rank(speedup: float) -> float:
    return math.inf if math.isnan(speedup) else speedup


def propose(drafters: Dict[str, Drafting], costs: CostModel, ask: DraftRequest) -> Proposal:
    """The first non-empty draft in this step's drafting order (:class:`Proposal`), decided; the
    caller learns from it (the policy's hindsight takes ``wholes``).

    With ``ask.cut`` (adaptive or ``auto``): a drafter that cuts its drafts proposes ``k_cap``
    tokens and the policy's :meth:`~.policy.length.DraftLengthPolicy.cut` decides how much of it
    this step verifies (none: the next drafter's turn).

    Under a grammar (any mode but ``off``), the text it forces from here (keys, punctuation,
    the rest of an enum literal) comes first, drafted without a model, up to ``forced_cap`` tokens
    (which may exceed K: such tokens cost no drafting and are nearly always accepted); a drafter
    continues from there within K, and its draft is cut before the first token the grammar refuses
    (that token could never be accepted, and would cost a verify row). A drafter that cuts its
    constrained drafts too (the suffix drafter) is then cut by its policy as above, the forced
    rows counted in the pass's cost; the others draft the length their policy decides per step.
    The chosen draft's rows are then walked once for their masks (the grammar's state unmoved)."""
    grammar = ask.grammar
    proposal = _decide_draft(drafters, costs, ask)
    if grammar is None:
        return proposal
    return replace(proposal, masks=grammar.row_masks(proposal.draft.tokens))


def _decide_draft(drafters: Dict[str, Drafting], costs: CostModel, ask: DraftRequest) -> Proposal:
    if ask.k_cap <= 0:
        return NO_PROPOSAL
    spec, grammar = ask.spec, ask.grammar
    order = drafting_order(ask.mode, drafters, ask.k_cap, spec.adaptive, ask.cut, grammar is not None, ask.share)
    forced: List[int] = []
    if grammar is not None and ask.mode != "off":
        forced = grammar.forced_tokens(max(ask.k_cap, ask.forced_cap))
    context, n_forced, room = list(ask.context) + forced, len(forced), ask.k_cap - len(forced)
    chosen: Tuple[Draft, Decision] = (EMPTY_DRAFT, PLAIN_STEP)
    n_cut, wholes = 0, []
    for drafting, decision, cutting in order:  # the first non-empty draft in the drafting order
        if room <= 0:
            break
        started = time.perf_counter()
        draft = drafting.drafter.propose(context, min(decision.draft_len, room), spec)
        if draft.tokens and grammar is not None:  # cut before the first token the grammar refuses
            keep = grammar.allowed_after(forced, draft.tokens)
            n_cut += len(draft) - keep
            draft = draft.prefix(keep)
        if cutting and draft.evidence is not None:
            wholes.append(draft)
            costs.observe_draft_time(draft.source, len(draft), time.perf_counter() - started)
            decision = drafting.policy.cut(draft.evidence, n_forced, ask.share)
            draft = draft.prefix(decision.draft_len)
        elif draft.tokens:
            costs.observe_draft_time(draft.source, len(draft), time.perf_counter() - started)
        if draft.tokens:
            chosen = (draft, decision)
            break
    draft, decision = chosen
    if draft.tokens:
        if forced:
            probs = None if draft.probs is None else (None,) * n_forced + draft.probs
            draft = Draft(tuple(forced) + draft.tokens, probs, draft.source)
        return Proposal(draft, decision, n_forced, n_cut=n_cut, wholes=tuple(wholes))
    if forced:
        return Proposal(Draft(tuple(forced), None, GRAMMAR_SOURCE), PLAIN_STEP, n_forced, n_cut=n_cut,
                        wholes=tuple(wholes))
    return Proposal(EMPTY_DRAFT, PLAIN_STEP, n_cut=n_cut, wholes=tuple(wholes))
