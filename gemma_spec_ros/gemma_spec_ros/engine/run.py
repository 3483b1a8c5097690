"""One request's state between target passes, and how a pass's tokens become a Step.

The engine owns the models and the loop (engine.py); a :class:`Run` owns what belongs to one
request: its sampler and seed stream, the tokens decoded and emitted so far, the text assembled
from them, its stats, and the rule that ends it (max_tokens, end-of-generation, stop strings, the
context, cancel, the time budget).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np

from .grammar import Grammar
from .sampling import Sampler
from .stats import SpecStats
from .text import TextAssembler
from .types import GenerationRequest, Step
from .uncut import UncutDrafts

#: Step.detail when max_tokens ends a constrained request early.
GRAMMAR_INCOMPLETE = ("max_tokens ran out before the grammar was complete: the text is not a whole "
                      "match of the grammar / json_schema (raise max_tokens)")


@dataclass
class Run:
    """One request's state between steps."""

    request: GenerationRequest
    sampler: Sampler
    rng: np.random.Generator
    stats: SpecStats
    text: TextAssembler
    prompt: List[int]
    # spec.verification at the start, kept for the whole request (a change applies to the next one)
    verification: str
    use_rejection: bool  # rejection verification, and the request samples (greedy is exact)
    grammar: Optional[Grammar] = None  # the request's constraint (grammar or json_schema), if any
    context: List[int] = field(default_factory=list)  # tokens the target has decoded
    pending: int = -1  # the last emitted token: sampled, not yet decoded by the target
    generated: List[int] = field(default_factory=list)  # tokens emitted so far
    started: float = field(default_factory=time.perf_counter)  # when generate() took the request
    uncut: UncutDrafts = field(default_factory=UncutDrafts)  # whole drafts before their cut (uncut.py)

    def over_budget(self) -> bool:
        budget = self.request.time_budget
        return bool(budget) and time.perf_counter() - self.started >= budget

    def mode_label(self, engine_mode: str, source: Optional[str] = None) -> str:
        """What stats and feedback call the mode of a step: ``auto:<drafter>`` under auto."""
        mode = self.request.spec_mode or engine_mode
        return f"auto:{source or 'off'}" if mode == "auto" else mode

    def emit(self, tokens: Sequence[int], mode_label: str, draft_max: int, *,
             is_eog: Callable[[int], bool], context_full: Callable[[], bool],
             stop_requested: Callable[[], bool], plain_token_time: float) -> Step:
        """The Step of tokens a pass produced: cut at max_tokens and at end-of-generation, text cut
        at stop strings, ``finish_reason`` set when the generation ends here. The callables are
        asked only when the earlier reasons to finish did not hold."""
        stats, max_tokens, generated = self.stats, self.request.max_tokens, self.generated
        room = max_tokens - len(generated)
        emitted: List[int] = []
        eos_hit = False
        for token in tokens[:max(0, room)]:
            if is_eog(token):
                eos_hit = True
                break
            emitted.append(token)
        generated.extend(emitted)
        new_text = self.text.push(emitted)
        finish = None
        if self.text.stopped or eos_hit:
            finish = "stop"
        elif len(generated) >= max_tokens or context_full():
            finish = "length"
        elif stop_requested():
            finish = "cancelled"
        elif self.over_budget():
            finish = "timeout"
        detail = ""
        if finish is not None:
            new_text += self.text.flush()
            if finish == "length" and self.grammar is not None and not self.grammar.complete():
                detail = GRAMMAR_INCOMPLETE
        stats.num_generated_tokens = len(generated)
        stats.spec_mode, stats.draft_max, stats.verification = mode_label, draft_max, self.verification
        stats.plain_token_time = plain_token_time
        if self.grammar is not None:
            stats.num_grammar_masks, stats.grammar_time = self.grammar.masks, self.grammar.seconds
        return Step(tuple(emitted), new_text, stats.snapshot(), mode_label, draft_max, finish, detail)
