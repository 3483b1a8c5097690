"""One request's state between target passes, and how a pass's tokens become a Step.

The engine owns the models and the loop (engine.py); a :class:`RequestState` owns what belongs to
one request: its sampler and seed stream, the tokens decoded and emitted so far, the text assembled
from them, its stats, and the rule that ends it (max_tokens, end-of-generation, stop strings, the
context, cancel, the time budget). Every :class:`~.request.Step` a request yields is built here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from .config import SpecConfig
from .detokenize import TextAssembler
from .grammar.matcher import Grammar
from .policy.hindsight import DraftHindsight
from .request import GenerationRequest, Step
from .sampling import Sampler
from .stats import SpecStats

if TYPE_CHECKING:
    from .chat.reply import ReplyStream

#: Step.detail when max_tokens ends a constrained request early.
GRAMMAR_INCOMPLETE = ("max_tokens ran out before the grammar was complete: the text is not a whole "
                      "match of the grammar / json_schema (raise max_tokens)")


@dataclass(frozen=True)
class Ends:
    """What a request's end depends on outside it, asked only when the earlier reasons to finish
    did not hold: an end-of-generation token, a full context, a stop requested (cancel, close)."""

    is_eog: Callable[[int], bool]
    context_full: Callable[[], bool]
    stop_requested: Callable[[], bool]


@dataclass
class RequestState:
    """One request's state between steps."""

    request: GenerationRequest
    sampler: Sampler
    rng: np.random.Generator
    stats: SpecStats
    text: Union[TextAssembler, "ReplyStream"]  # a chat turn's: its reply stream (the message's text)
    prompt: List[int]
    ends: Ends
    hindsight: DraftHindsight  # whole drafts before their cut (policy/hindsight.py)
    # spec.verification at the start, kept for the whole request (a change applies to the next one)
    verification: str
    use_rejection: bool  # rejection verification, and the request samples (greedy is exact)
    grammar: Optional[Grammar] = None  # the request's constraint (grammar or json_schema), if any
    context: List[int] = field(default_factory=list)  # tokens the target has decoded
    pending: int = -1  # the last emitted token: sampled, not yet decoded by the target
    generated: List[int] = field(default_factory=list)  # tokens emitted so far
    started: float = field(default_factory=time.perf_counter)  # when generate() took the request
    source: Optional[str] = None  # the drafter whose draft the last pass verified (None: none)
    #: the target's KV sequence this request decodes in (the model itself, or one sequence of it
    #: when several requests run at once: llama/model.py SequenceView)
    kv: Any = None
    #: the drafters (with their policies) this request drafts with: the engine's, or a slot's own
    drafters: Dict[str, Any] = field(default_factory=dict)
    #: the prompt as the engine prepared it (request.py PlainPrompt, or a chat turn): what happens
    #: around the prompt pass, and what the text stream makes of the tokens
    prepared: Any = None

    def mode(self, spec: SpecConfig) -> str:
        """The mode of a step: the request's own, else the engine's at this step."""
        return self.request.spec_mode or spec.mode

    def over_budget(self) -> bool:
        budget = self.request.time_budget
        return bool(budget) and time.perf_counter() - self.started >= budget

    def mode_label(self, spec: SpecConfig, source: Optional[str] = None) -> str:
        """What stats and feedback call the mode of a step: ``auto:<drafter>`` under auto."""
        mode = self.mode(spec)
        return f"auto:{source or 'off'}" if mode == "auto" else mode

    def emit(self, tokens: Sequence[int], spec: SpecConfig, source: Optional[str] = None) -> Step:
        """The Step of tokens a pass produced (``source``: whose draft it verified): cut at
        max_tokens and at end-of-generation, text cut at stop strings, ``finish_reason`` set when
        the generation ends here."""
        self.source = source
        max_tokens, generated, ends = self.request.max_tokens, self.generated, self.ends
        room = max_tokens - len(generated)
        emitted: List[int] = []
        eos_hit = False
        for token in tokens[:max(0, room)]:
            if ends.is_eog(token):
                eos_hit = True
                break
            emitted.append(token)
        generated.extend(emitted)
        new_text = self.text.push(emitted)
        finish = None
        if self.text.stopped or eos_hit:
            finish = "stop"
        elif len(generated) >= max_tokens or ends.context_full():
            finish = "length"
        elif ends.stop_requested():
            finish = "cancelled"
        elif self.over_budget():
            finish = "timeout"
        return self.step(spec, finish, emitted, new_text)

    def step(self, spec: SpecConfig, finish: Optional[str] = None, emitted: Sequence[int] = (),
             new_text: str = "") -> Step:
        """The Step of these emitted tokens and their text (none: a request stopped between two
        passes); on the last one (``finish`` set) the text held back for a stop string is let out."""
        stats, label, detail, reply = self.stats, self.mode_label(spec, self.source), "", None
        if finish is not None:
            new_text += self.text.flush()
            if finish == "length" and self.grammar is not None and not self.grammar.complete():
                detail = GRAMMAR_INCOMPLETE
            reply = self.text.final(finish)  # a chat turn's message: text, calls parsed and validated
        stats.num_generated_tokens = len(self.generated)
        stats.spec_mode, stats.draft_max, stats.verification = label, spec.draft_max, self.verification
        if self.grammar is not None:
            stats.num_grammar_masks, stats.grammar_time = self.grammar.masks, self.grammar.seconds
        return Step(tuple(emitted), new_text, stats.snapshot(), label, spec.draft_max, finish, detail, reply)
