"""Shadow drafts: acceptance learned for free while a drafter's policy is off.

When the draft-length policy predicts that drafting does not pay, it turns its drafter off and
only probes now and then, each probe costing a verify pass with an extra row. What it then knows
of acceptance is stale, and a stretch of text that copies the prompt can go by undrafted: on the
replay of 22 prompts (docs/benchmarks.md, issue 25) adaptive lookup stayed at plain speed on 7 of
them where a fixed K of 3 ran 1.4-1.9x, because its probes came too rarely and too early.

A drafter whose drafts run no model (n-gram lookup: ``Drafter.free_drafts``) can still draft at a
plain step without verifying: the tokens the following steps emit then say how much of that draft
would have been accepted (under greedy decoding, exactly: a draft token is accepted iff it is the
token emitted), and the policy learns from it (``DraftLengthPolicy.observe_shadow``) at the cost
of a few dictionary lookups. Output is untouched: a shadow draft is never decoded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from .policy import DraftLengthPolicy
from .types import Drafter


@dataclass
class _Pending:
    tokens: Tuple[int, ...]
    start: int  # index in the request's emitted tokens of the token the draft's first one guesses


class ShadowDrafts:
    """One request's unverified drafts, at most one per drafter, until the emitted tokens settle them."""

    def __init__(self) -> None:
        self._pending: Dict[str, _Pending] = {}

    @property
    def pending(self) -> bool:
        """Whether a shadow draft waits for the tokens that settle it."""
        return bool(self._pending)

    def settle(self, emitted: Sequence[int], policies: Dict[str, DraftLengthPolicy]) -> None:
        """Check every pending draft against the tokens emitted so far; a draft is settled at its
        first wrong token or once it was matched whole, and its policy observes it."""
        for name, pending in list(self._pending.items()):
            seen = emitted[pending.start:pending.start + len(pending.tokens)]
            matched = 0
            for guess, actual in zip(pending.tokens, seen):
                if guess != actual:
                    break
                matched += 1
            if matched < len(seen) or matched == len(pending.tokens):
                policies[name].observe_shadow(len(pending.tokens), matched)
                del self._pending[name]

    def draft(self, candidates: Iterable[Tuple[Drafter, DraftLengthPolicy]], used: str,
              context: List[int], n_emitted: int, k_cap: int) -> None:
        """At a step that verifies no draft of theirs: a shadow draft from each drafter that drafts
        for free, whose policy is off, and that has none pending. ``used`` names the drafter whose
        draft this step verifies ('' for none); ``n_emitted`` counts the tokens emitted before the
        step, the first of whose own tokens the draft guesses."""
        for drafter, policy in candidates:
            name = drafter.name
            if not drafter.free_drafts or policy.enabled or name == used or name in self._pending:
                continue
            tokens = drafter.propose(context, k_cap).tokens
            if tokens:
                self._pending[name] = _Pending(tuple(tokens), n_emitted)
