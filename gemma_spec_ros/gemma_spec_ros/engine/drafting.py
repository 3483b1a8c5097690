"""Which drafter drafts a step: the table of the drafters each mode may use, the order a step tries
them in, and the draft one verify pass checks (under a grammar: the text it forces first, then a
drafter's continuation, cut before the first token the grammar refuses)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .grammar import Grammar
from .policy import PLAIN_STEP, CostModel, Decision, DraftLengthPolicy
from .stats import SpecStats
from .types import EMPTY_DRAFT, Draft, Drafter, SpecConfig

#: The drafters (by ``Drafter.name``) each mode may use, in the order a step tries them: the first
#: non-empty draft is verified. ``auto`` reorders them at every step (see :func:`drafting_order`).
DRAFTERS_BY_MODE: Dict[str, Tuple[str, ...]] = {
    "off": (),
    "draft": ("draft",),
    "lookup": ("lookup",),
    "draft+lookup": ("lookup", "draft"),
    "auto": ("lookup", "draft", "mtp"),
    "mtp": ("mtp",),  # Gemma 4's assistant (engine/mtp.py); "draft" is a standalone model
}


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


def drafting_order(mode: str, drafters: Dict[str, Drafting], k_cap: int,
                   adaptive: bool, cut: bool = False) -> Iterator[Tuple[Drafting, Decision]]:
    """The drafters one step tries, in order, each with its policy's decision (draft length > 0).

    ``draft+lookup`` (and the one-drafter modes) is a fixed chain in table order that honours
    ``adaptive`` (``spec.adaptive``); a policy is asked only when its drafter's turn comes.
    ``auto`` is always adaptive: it asks every policy first and tries the best predicted speedup
    first (not measured yet counts as best; ties keep table order), or drafts nothing.

    ``cut`` (no grammar): an adaptive drafter that cuts its own drafts is always tried, with the
    whole ``k_cap``; its policy cuts the draft afterwards (:func:`propose`).
    """
    chain = [drafters[name] for name in DRAFTERS_BY_MODE[mode] if name in drafters]
    if mode != "auto":
        for drafting in chain:
            decision = _decide(drafting, k_cap, adaptive, cut)
            if decision.draft_len > 0:
                yield drafting, decision
        return
    decided = [(drafting, _decide(drafting, k_cap, True, cut)) for drafting in chain]
    decided.sort(key=lambda pair: -_rank(pair[1].predicted_speedup))
    yield from ((drafting, decision) for drafting, decision in decided if decision.draft_len > 0)


def _cutting(drafting: Drafting, adaptive: bool, cut: bool) -> bool:
    """Whether this step drafts ``k_cap`` with ``drafting`` and its policy cuts the draft."""
    return cut and adaptive and drafting.drafter.cuts_drafts


def _decide(drafting: Drafting, k_cap: int, adaptive: bool, cut: bool) -> Decision:
    if _cutting(drafting, adaptive, cut):
        # ranked in auto by what its verified drafts have shown (the policy's S at its best k)
        return Decision(k_cap, drafting.policy.best(k_cap).predicted_speedup)
    return drafting.policy.decide(k_cap, adaptive)


def _rank(speedup: float) -> float:
    return math.inf if math.isnan(speedup) else speedup


def propose(drafters: Dict[str, Drafting], costs: CostModel, mode: str, spec: SpecConfig,
            context: List[int], k_cap: int, grammar: Optional[Grammar] = None,
            stats: Optional[SpecStats] = None, forced_cap: int = 0, cut: bool = False,
            on_uncut: Optional[Callable[[Draft], None]] = None) -> Tuple[Draft, Decision, int]:
    """The first non-empty draft in this step's drafting order, with its policy's decision, and
    how many of its first tokens the grammar forced (0 without a grammar).

    ``cut`` (adaptive or ``auto``; ignored under a grammar): a drafter that cuts its drafts proposes
    ``k_cap`` tokens; ``on_uncut`` gets the whole draft (checked later against the emitted tokens:
    it teaches the policy's evidence model), and the policy's :meth:`~DraftLengthPolicy.cut` decides
    how much of it this step verifies (none: the next drafter's turn).

    Under a grammar (any mode but ``off``), the text it forces from here (keys, punctuation,
    the rest of an enum literal) comes first, drafted without a model, up to ``forced_cap`` tokens
    (which may exceed K: such tokens cost no drafting and are nearly always accepted); a drafter
    continues from there within K, and its draft is cut before the first token the grammar refuses
    (that token could never be accepted, and would cost a verify row)."""
    if k_cap <= 0:
        return EMPTY_DRAFT, PLAIN_STEP, 0
    forced: List[int] = []
    if grammar is not None and mode != "off":
        forced = grammar.forced_tokens(max(k_cap, forced_cap))
        grammar.advance(forced)  # the drafter's continuation is checked from after them
    try:
        draft, decision = _drafted(drafters, costs, mode, spec, context + forced if forced else context,
                                   k_cap - len(forced), k_cap, grammar, stats, cut, on_uncut)
    finally:
        if grammar is not None:
            grammar.rollback(len(forced))  # verification walks the draft from the state it started at
    if draft.tokens:
        if forced:
            probs = None if draft.probs is None else (None,) * len(forced) + draft.probs
            draft = Draft(tuple(forced) + draft.tokens, probs, draft.source)
        return draft, decision, len(forced)
    if forced:
        return Draft(tuple(forced), None, GRAMMAR_SOURCE), PLAIN_STEP, len(forced)
    return EMPTY_DRAFT, PLAIN_STEP, 0


def _drafted(drafters: Dict[str, Drafting], costs: CostModel, mode: str, spec: SpecConfig,
             context: List[int], room: int, k_cap: int, grammar: Optional[Grammar],
             stats: Optional[SpecStats], cut: bool,
             on_uncut: Optional[Callable[[Draft], None]]) -> Tuple[Draft, Decision]:
    """The first non-empty drafter draft of this step (at most ``room`` tokens after ``context``),
    cut before the first token ``grammar`` refuses in its present state; ``EMPTY_DRAFT`` if none."""
    cut = cut and grammar is None
    for drafting, decision in drafting_order(mode, drafters, k_cap, spec.adaptive, cut):
        if room <= 0:
            break
        started = time.perf_counter()
        cutting = _cutting(drafting, spec.adaptive or mode == "auto", cut)
        draft = drafting.drafter.propose(context, min(decision.draft_len, room), spec)
        if cutting and draft.evidence is not None:
            if on_uncut is not None:
                on_uncut(draft)
            costs.observe_draft_time(draft.source, len(draft), time.perf_counter() - started)
            decision = drafting.policy.cut(draft.evidence)
            draft = _cut(draft, decision.draft_len)
            if draft.tokens:
                return draft, decision
            continue
        if draft.tokens and grammar is not None:
            keep = grammar.allowed_prefix(draft.tokens)
            if stats is not None:
                stats.num_grammar_cut_tokens += len(draft) - keep
            draft = _cut(draft, keep)
        if draft.tokens:
            costs.observe_draft_time(draft.source, len(draft), time.perf_counter() - started)
            return draft, decision
    return EMPTY_DRAFT, PLAIN_STEP


def _cut(draft: Draft, keep: int) -> Draft:
    """``draft`` cut to its first ``keep`` tokens."""
    if keep >= len(draft):
        return draft
    if keep == 0:
        return EMPTY_DRAFT
    probs = None if draft.probs is None else draft.probs[:keep]
    evidence = None if draft.evidence is None else draft.evidence[:keep]
    return Draft(draft.tokens[:keep], probs, draft.source, evidence)
