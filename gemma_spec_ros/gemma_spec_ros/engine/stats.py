"""Statistics of speculative decoding: one dataclass, one mutator per event.

Glossary (vLLM's words, llama.cpp's counters):

- **drafted**: tokens a drafter proposed for one verify pass (K_step <= K).
- **accepted**: drafted tokens the target agreed with, a prefix of the draft.
- **recovered**: the token the target emits at the first rejected position (its own sample there).
- **bonus**: the token the target emits after a fully accepted draft (one row past the draft).

Every verify pass emits ``accepted + 1`` tokens (the +1 is the recovered or bonus token), so

- acceptance rate ``= accepted / drafted``
- mean acceptance length ``tau = 1 + accepted / drafts`` (tokens per target pass that had a draft).

Worked example: three drafts of 4 tokens with 4, 1 and 0 accepted emit 5 + 2 + 1 = 8 tokens in 3
passes: acceptance rate 5/12 = 0.42, tau = 1 + 5/3 = 2.67, acceptance per position
[2/3, 1/3, 1/3, 1/3], acceptance histogram [1, 1, 0, 0, 1] (one pass each accepted 0, 1 and 4).

The histogram's and the per-source counts' invariants (vLLM's per-request summary):
``sum(h) == num_drafts``, ``sum(i * h[i]) == num_accepted_tokens``, and the sources' drafted and
accepted tokens add up to ``num_draft_tokens`` and ``num_accepted_tokens``. Drafted tokens are
counted after the grammar cut the ones it refuses (``num_grammar_cut_tokens``: vLLM subtracts its
grammar-invalidated draft tokens the same way).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Dict, List, Tuple


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


#: The source under which the tokens a grammar forced are counted (``propose.GRAMMAR_SOURCE``, also
#: the ``Draft.source`` of a draft the grammar forced whole).
FORCED_SOURCE = "grammar"
#: The kinds of draft source the message reports (``num_<kind>_draft_tokens``...): n-gram lookup,
#: suffix decoding, a model (draft model, Gemma 4 assistant, EAGLE-3 head: every other drafter),
#: and the grammar's forced text.
SOURCE_KINDS = ("lookup", "suffix", "model", FORCED_SOURCE)


def source_kind(source: str) -> str:
    """The kind (:data:`SOURCE_KINDS`) a drafter's name (``Draft.source``) counts under.

    >>> [source_kind(s) for s in ("lookup", "suffix", "draft", "mtp", "eagle3", "grammar")]
    ['lookup', 'suffix', 'model', 'model', 'model', 'grammar']
    """
    return source if source in SOURCE_KINDS else "model"


# How SpecStats.merge combines a field of the running total with the same field of one more request.
_SUM = {"merge": "sum"}  # counters and times add up (lists element-wise, dicts per key)
_LAST = {"merge": "last"}  # the newest request's value: a state or label, not a quantity
_LAST_KNOWN = {"merge": "last_known"}  # the newest value that is not NaN


@dataclass
class SpecStats:
    """Counters and timers of one request, or of several merged (:meth:`merge`). Times in seconds.

    Each field's metadata says how requests merge: ``sum`` for counters and times, ``last`` for
    states and labels, which in merged stats are those of the last request merged.
    """

    spec_mode: str = field(default="off", metadata=_LAST)  # mode in effect at the last step
    verification: str = field(default="exact", metadata=_LAST)
    draft_max: int = field(default=0, metadata=_LAST)  # K in effect at the last step
    draft_last: int = field(default=0, metadata=_LAST)  # draft length used at the last step
    num_drafts: int = field(default=0, metadata=_SUM)  # verify passes with a non-empty draft
    num_draft_tokens: int = field(default=0, metadata=_SUM)
    num_accepted_tokens: int = field(default=0, metadata=_SUM)
    # all tokens emitted, the first (sampled from the prompt pass) too
    num_generated_tokens: int = field(default=0, metadata=_SUM)
    # tokens emitted by decode steps after the prompt (for tokens/s)
    num_step_tokens: int = field(default=0, metadata=_SUM)
    num_steps: int = field(default=0, metadata=_SUM)  # target passes after the prompt (verify or plain)
    num_prompt_tokens: int = field(default=0, metadata=_SUM)
    # prompt tokens whose KV came from the previous request (prompt reuse)
    num_prompt_tokens_reused: int = field(default=0, metadata=_SUM)
    # drafts accepted at position i / drafts that reached position i
    accepted_at: List[int] = field(default_factory=list, metadata=_SUM)
    drafted_at: List[int] = field(default_factory=list, metadata=_SUM)
    drafts_by_source: Dict[str, int] = field(default_factory=dict, metadata=_SUM)
    # verify passes with a non-empty draft that accepted exactly i drafted tokens (i = 0..longest draft)
    acceptance_histogram: List[int] = field(default_factory=list, metadata=_SUM)
    # drafted / accepted tokens by who drafted them (Draft.source: lookup, suffix, draft, mtp,
    # eagle3); a grammar's forced tokens under FORCED_SOURCE, its draft's continuation under its drafter
    draft_tokens_by_source: Dict[str, int] = field(default_factory=dict, metadata=_SUM)
    accepted_tokens_by_source: Dict[str, int] = field(default_factory=dict, metadata=_SUM)
    # constrained requests (engine/grammar/matcher.py): drafted tokens the grammar forced (no model ran for
    # them), those of them the target accepted, whole-vocabulary masks, time in llguidance
    num_grammar_draft_tokens: int = field(default=0, metadata=_SUM)
    num_grammar_accepted_tokens: int = field(default=0, metadata=_SUM)
    num_grammar_masks: int = field(default=0, metadata=_SUM)
    # drafted tokens cut before verification because the grammar refused them (and all after them)
    num_grammar_cut_tokens: int = field(default=0, metadata=_SUM)
    # verify rows decoded without logits: the grammar allowed the draft's next token alone there
    num_grammar_sole_rows: int = field(default=0, metadata=_SUM)
    grammar_time: float = field(default=0.0, metadata=_SUM)
    prompt_time: float = field(default=0.0, metadata=_SUM)
    draft_time: float = field(default=0.0, metadata=_SUM)
    # target decode passes (with or without a draft)
    verify_time: float = field(default=0.0, metadata=_SUM)
    sample_time: float = field(default=0.0, metadata=_SUM)
    # request start to the first token; merged: the last request's (not a mean)
    time_to_first_token: float = field(default=math.nan, metadata=_LAST)
    # wall time of the decode steps after the prompt pass
    generation_time: float = field(default=0.0, metadata=_SUM)
    predicted_speedup: float = field(default=math.nan, metadata=_LAST)  # at the last step
    # measured cost of one plain decode step on this device
    plain_token_time: float = field(default=math.nan, metadata=_LAST_KNOWN)
    # goal acceptance to the start of generation, set by whoever queued the request (the node)
    queue_wait: float = field(default=0.0, metadata=_SUM)

    # -- mutators ---------------------------------------------------------------------------------
    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int, source: str = "",
                      num_forced: int = 0) -> None:
        """One verify pass of a ``num_draft_tokens`` draft accepted its first ``num_accepted_tokens``;
        its first ``num_forced`` tokens a grammar forced (counted under :data:`FORCED_SOURCE`), the
        rest ``source`` drafted.

        >>> s = SpecStats(); s.observe_draft(4, 4); s.observe_draft(4, 1); s.observe_draft(4, 0)
        >>> round(s.mean_acceptance_length, 2), round(s.acceptance_rate, 2), s.acceptance_per_position
        (2.67, 0.42, [0.6666666666666666, 0.3333333333333333, 0.3333333333333333, 0.3333333333333333])
        >>> s.acceptance_histogram
        [1, 1, 0, 0, 1]
        """
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of a {num_draft_tokens}-token draft")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.draft_last = num_draft_tokens
        if source:
            self.drafts_by_source[source] = self.drafts_by_source.get(source, 0) + 1
        grow = num_draft_tokens - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(num_draft_tokens):
            self.drafted_at[i] += 1
            if i < num_accepted_tokens:
                self.accepted_at[i] += 1
        histogram = self.acceptance_histogram
        if len(histogram) <= num_draft_tokens:
            histogram.extend([0] * (num_draft_tokens + 1 - len(histogram)))
        histogram[num_accepted_tokens] += 1
        forced = min(max(num_forced, 0), num_draft_tokens)
        if forced:
            self.num_grammar_draft_tokens += forced
            self.num_grammar_accepted_tokens += min(forced, num_accepted_tokens)
        for name, drafted, accepted in ((FORCED_SOURCE, forced, min(forced, num_accepted_tokens)),
                                        (source, num_draft_tokens - forced,
                                         max(0, num_accepted_tokens - forced))):
            if drafted:
                self.draft_tokens_by_source[name] = self.draft_tokens_by_source.get(name, 0) + drafted
                self.accepted_tokens_by_source[name] = self.accepted_tokens_by_source.get(name, 0) + accepted

    def merge(self, other: "SpecStats") -> None:
        """Fold one more request into these stats, field by field as its metadata says (sum,
        last, last known).

        >>> a, b = SpecStats(num_steps=2, accepted_at=[1]), SpecStats(num_steps=3, accepted_at=[1, 1])
        >>> a.time_to_first_token, b.time_to_first_token = 0.5, 0.25
        >>> a.merge(b); a.num_steps, a.accepted_at, a.time_to_first_token
        (5, [2, 1], 0.25)
        """
        for f in fields(self):
            rule, theirs = f.metadata["merge"], getattr(other, f.name)
            mine = getattr(self, f.name)
            if rule == "last" or (rule == "last_known" and not math.isnan(theirs)):
                setattr(self, f.name, theirs)
            elif rule == "sum" and isinstance(mine, list):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
            elif rule == "sum" and isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            elif rule == "sum":
                setattr(self, f.name, mine + theirs)

    def snapshot(self) -> "SpecStats":
        """An independent copy (lists copied), safe to hand to another thread.

        Taken at every step: a copy of the instance dict, not ``dataclasses.replace`` (which runs
        ``__init__`` over every field: ~15 us, a tenth of a small model's decode step)."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.accepted_at, copy.drafted_at = list(self.accepted_at), list(self.drafted_at)
        copy.drafts_by_source = dict(self.drafts_by_source)
        copy.acceptance_histogram = list(self.acceptance_histogram)
        copy.draft_tokens_by_source = dict(self.draft_tokens_by_source)
        copy.accepted_tokens_by_source = dict(self.accepted_tokens_by_source)
        return copy

    # -- derived ----------------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (NaN before the first draft)."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts, the bonus token included (NaN before the first draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_per_position(self) -> List[float]:
        """Share of drafts accepted at position i, over the drafts that reached position i.

        Denominator = drafts at least i+1 long, so a short draft does not count as a rejection
        further out."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def tokens_by_kind(self) -> Dict[str, Tuple[int, int]]:
        """(drafted, accepted) tokens of each kind of source (:data:`SOURCE_KINDS`), 0 for none.

        >>> s = SpecStats(); s.observe_draft(5, 3, "mtp", num_forced=2); s.observe_draft(2, 0, "lookup")
        >>> s.tokens_by_kind()
        {'lookup': (2, 0), 'suffix': (0, 0), 'model': (3, 1), 'grammar': (2, 2)}
        """
        kinds = {kind: [0, 0] for kind in SOURCE_KINDS}
        for source, drafted in self.draft_tokens_by_source.items():
            counts = kinds[source_kind(source)]
            counts[0] += drafted
            counts[1] += self.accepted_tokens_by_source.get(source, 0)
        return {kind: (drafted, accepted) for kind, (drafted, accepted) in kinds.items()}

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens emitted by steps after the prompt pass / time of those steps
        (llama.cpp's eval tokens/s; the prompt pass and its first token are in TTFT instead)."""
        return _ratio(self.num_step_tokens, self.generation_time)

    @property
    def measured_speedup(self) -> float:
        """Decode speed relative to plain decoding at the measured plain step cost on this device
        (tokens/s x seconds per plain step)."""
        if math.isnan(self.plain_token_time) or not self.generation_time or not self.num_step_tokens:
            return math.nan
        return (self.num_step_tokens * self.plain_token_time) / self.generation_time

    def as_dict(self) -> Dict[str, object]:
        """Plain dict of counters and derived values (times in ms) for JSON and ROS messages.

        The tokens by source are there twice: by drafter (``draft_tokens_by_source``...) and by
        kind of source (``num_<kind>_draft_tokens``, ``num_<kind>_accepted_tokens``, the message's
        scalar fields; the grammar's are ``num_grammar_draft_tokens`` and
        ``num_grammar_accepted_tokens``)."""
        kinds = {}
        for kind, (drafted, accepted) in self.tokens_by_kind().items():
            if kind != FORCED_SOURCE:  # the grammar's are fields of their own (the same counts)
                kinds[f"num_{kind}_draft_tokens"], kinds[f"num_{kind}_accepted_tokens"] = drafted, accepted
        return {
            "spec_mode": self.spec_mode, "verification": self.verification,
            "draft_max": self.draft_max, "draft_last": self.draft_last,
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_step_tokens": self.num_step_tokens, "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_prompt_tokens_reused": self.num_prompt_tokens_reused,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
            "drafts_by_source": dict(self.drafts_by_source),
            "acceptance_histogram": list(self.acceptance_histogram),
            "draft_tokens_by_source": dict(self.draft_tokens_by_source),
            "accepted_tokens_by_source": dict(self.accepted_tokens_by_source),
            **kinds,
            "num_grammar_draft_tokens": self.num_grammar_draft_tokens,
            "num_grammar_accepted_tokens": self.num_grammar_accepted_tokens,
            "num_grammar_masks": self.num_grammar_masks, "grammar_ms": self.grammar_time * 1e3,
            "num_grammar_cut_tokens": self.num_grammar_cut_tokens,
            "num_grammar_sole_rows": self.num_grammar_sole_rows,
            "tokens_per_second": self.tokens_per_second,
            "time_to_first_token_ms": self.time_to_first_token * 1e3,
            "prompt_ms": self.prompt_time * 1e3, "draft_ms": self.draft_time * 1e3,
            "verify_ms": self.verify_time * 1e3, "sample_ms": self.sample_time * 1e3,
            "generation_ms": self.generation_time * 1e3, "queue_wait_ms": self.queue_wait * 1e3,
            "predicted_speedup": self.predicted_speedup, "measured_speedup": self.measured_speedup,
        }


class timed:  # noqa: N801  used as a function: ``with timed(stats, 'draft_time'):``
    """``with timed(stats, 'draft_time'):`` adds the seconds the block took to that field.

    A class, not a ``contextlib.contextmanager`` generator: three of these run at every step, and
    the generator machinery cost ~2 us each."""

    __slots__ = ("_stats", "_field", "_started")

    def __init__(self, stats: SpecStats, field_name: str) -> None:
        self._stats, self._field = stats, field_name

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        stats, name = self._stats, self._field
        setattr(stats, name, getattr(stats, name) + time.perf_counter() - self._started)


__all__ = ["FORCED_SOURCE", "SOURCE_KINDS", "SpecStats", "source_kind", "timed"]
