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
[2/3, 1/3, 1/3, 1/3].
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


@dataclass
class SpecStats:
    """Counters and timers of one request (or of an engine's lifetime). Times in seconds."""

    spec_mode: str = "off"  # mode in effect at the last step
    verification: str = "exact"
    draft_max: int = 0  # K in effect at the last step
    draft_last: int = 0  # draft length used at the last step
    num_drafts: int = 0  # verify passes with a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_generated_tokens: int = 0  # all tokens emitted, the first (sampled from the prompt pass) too
    num_step_tokens: int = 0  # tokens emitted by decode steps after the prompt (for tokens/s)
    num_steps: int = 0  # target passes after the prompt (verify or plain)
    num_prompt_tokens: int = 0
    num_prompt_tokens_reused: int = 0  # prompt tokens whose KV came from the previous request
    accepted_at: List[int] = field(default_factory=list)  # drafts accepted at position i
    drafted_at: List[int] = field(default_factory=list)  # drafts that reached position i
    drafts_by_source: Dict[str, int] = field(default_factory=dict)
    prompt_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0  # target decode passes (with or without a draft)
    sample_time: float = 0.0
    time_to_first_token: float = math.nan
    generation_time: float = 0.0  # wall time of the decode steps after the prompt pass
    predicted_speedup: float = math.nan
    plain_token_time: float = math.nan  # measured cost of one plain decode step on this device
    queue_wait: float = 0.0  # acceptance to start of generation, set by whoever queued the request

    # -- mutators ---------------------------------------------------------------------------------
    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int, source: str = "") -> None:
        """One verify pass of a ``num_draft_tokens`` draft accepted its first ``num_accepted_tokens``.

        >>> s = SpecStats(); s.observe_draft(4, 4); s.observe_draft(4, 1); s.observe_draft(4, 0)
        >>> round(s.mean_acceptance_length, 2), round(s.acceptance_rate, 2), s.acceptance_per_position
        (2.67, 0.42, [0.6666666666666666, 0.3333333333333333, 0.3333333333333333, 0.3333333333333333])
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

    def merge(self, other: "SpecStats") -> None:
        """Add another request's counters and times (for rolling, per-engine stats)."""
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_generated_tokens",
                     "num_step_tokens", "num_steps", "num_prompt_tokens", "num_prompt_tokens_reused", "prompt_time", "draft_time", "verify_time",
                     "sample_time", "generation_time", "queue_wait"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        for k, v in other.drafts_by_source.items():
            self.drafts_by_source[k] = self.drafts_by_source.get(k, 0) + v
        self.spec_mode, self.verification = other.spec_mode, other.verification
        self.draft_max, self.draft_last = other.draft_max, other.draft_last
        self.time_to_first_token = other.time_to_first_token
        self.predicted_speedup = other.predicted_speedup
        if not math.isnan(other.plain_token_time):
            self.plain_token_time = other.plain_token_time

    def snapshot(self) -> "SpecStats":
        """An independent copy (lists copied), safe to hand to another thread."""
        return replace(self, accepted_at=list(self.accepted_at), drafted_at=list(self.drafted_at),
                       drafts_by_source=dict(self.drafts_by_source))

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
        """Plain dict of counters and derived values (times in ms) for JSON and ROS messages."""
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
            "tokens_per_second": self.tokens_per_second,
            "time_to_first_token_ms": self.time_to_first_token * 1e3,
            "prompt_ms": self.prompt_time * 1e3, "draft_ms": self.draft_time * 1e3,
            "verify_ms": self.verify_time * 1e3, "sample_ms": self.sample_time * 1e3,
            "generation_ms": self.generation_time * 1e3, "queue_wait_ms": self.queue_wait * 1e3,
            "predicted_speedup": self.predicted_speedup, "measured_speedup": self.measured_speedup,
        }


class Stopwatch:
    """``with watch('draft_time'):`` adds the elapsed seconds to that field of a SpecStats."""

    __slots__ = ("_stats",)

    def __init__(self, stats: SpecStats) -> None:
        self._stats = stats

    def __call__(self, field_name: str) -> "_Lap":
        return _Lap(self._stats, field_name)


class _Lap:
    __slots__ = ("_stats", "_field", "_t0")

    def __init__(self, stats: SpecStats, field_name: str) -> None:
        self._stats, self._field, self._t0 = stats, field_name, 0.0

    def __enter__(self) -> "_Lap":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self._stats, self._field, getattr(self._stats, self._field) + time.perf_counter() - self._t0)


def now() -> float:
    return time.perf_counter()


__all__ = ["SpecStats", "Stopwatch", "now"]
