"""Uncut drafts: what a drafter's whole draft would have earned, learned for free.

A drafter whose drafts run no model and say what each token rests on (n-gram lookup:
``Drafter.cuts_drafts``, ``Draft.evidence``) drafts long at every step, and its policy cuts the
draft where the expected gain peaks (policy.py, "Cutting each draft"). To judge the tokens past the
cut it must know how such tokens fare, and the verify pass never sees them. The tokens the request
goes on to emit do: under greedy decoding a draft token is accepted iff it is the token emitted
(under rejection sampling too, for these one-hot drafts). So every whole draft is kept and checked
token by token as the text comes, and each checked token teaches the policy's acceptance of its
evidence class (:class:`~gemma_spec_ros.engine.policy.acceptance.EvidenceAcceptance`). A policy that cut every
draft to nothing still learns this way, so it drafts again the moment the text turns predictable.

Output is untouched: nothing here reaches the target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Sequence

from .length import DraftLengthPolicy
from ..drafters.base import Draft


@dataclass
class _Uncut:
    draft: Draft
    start: int  # index in the emitted tokens of the token the draft's first one guesses
    seen: int = 0  # of its tokens already checked against the emitted ones


class DraftHindsight:
    """One request's whole drafts (before their cut), checked token by token against the tokens
    the request emits (module docstring). A draft is done at its first wrong token or once matched
    whole; one still open when the request ends is dropped."""

    def __init__(self, policies: Mapping[str, DraftLengthPolicy]) -> None:
        self._policies = policies  # the request's drafters' policies, by drafter name
        self._pending: List[_Uncut] = []

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def add(self, draft: Draft, n_emitted: int) -> None:
        """``draft`` guesses the tokens from emitted index ``n_emitted`` on."""
        if draft.tokens and draft.evidence is not None:
            self._policies[draft.source].evidence.age()
            self._pending.append(_Uncut(draft, n_emitted))

    def settle(self, emitted: Sequence[int]) -> None:
        """Check every open draft's tokens that the emitted ones now cover."""
        still = []
        for pending in self._pending:
            draft, model = pending.draft, self._policies[pending.draft.source].evidence
            done = False
            while pending.seen < len(draft.tokens) and pending.start + pending.seen < len(emitted):
                right = draft.tokens[pending.seen] == emitted[pending.start + pending.seen]
                model.observe_token(draft.evidence[pending.seen], pending.seen, right)
                pending.seen += 1
                if not right:
                    done = True
                    break
            if not done and pending.seen < len(draft.tokens):
                still.append(pending)
        self._pending = still
