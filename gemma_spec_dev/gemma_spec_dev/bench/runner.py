"""What every bench runner is and returns: one protocol, one result type, and the helpers every
runner measures with (no model imports here: the parent process uses them too).

The worker-side runners (the engine, llama-cpp-python, the Generate action; :mod:`.worker`) and the
parent-side ones (a worker handle; llama.cpp's native tools, :mod:`.native`) all answer ``run`` with
a :class:`RunResult`; ``record.make_record`` turns it into one row of results.json.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple

#: A request as the parent sends it: prompt, max_tokens, temperature, seed.
Request = Dict[str, Any]


@dataclass
class RunResult:
    """One request's outcome, as a runner measured it. Times in seconds."""

    text: str  # the generated text
    n_tokens: int  # tokens generated
    wall_s: float  # request to the last output, measured by the bench (native tools: their own)
    ttft_s: float  # request to the first output
    n_first: int = 0  # tokens in the first output (they are in TTFT, not in the decode rate)
    finish_reason: Optional[str] = None
    tokens: Optional[List[int]] = None  # the generated token ids, where the runner has them (engine)
    retokenized: Optional[List[int]] = None  # else the text re-tokenized (llama-cpp-python), for repetition
    decode_s: Optional[float] = None  # decode time the runner printed itself (native tools)
    stats: Optional[Dict[str, Any]] = None  # SpecStats figures by name, where the runner has them
    spec_modes: List[str] = field(default_factory=list)  # modes in effect, in order of appearance
    draft_max_last: Optional[int] = None  # K in effect at the end
    peak_rss_mb: Optional[float] = None  # peak RSS of the runner's process so far (set by the parent)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RunResult":
        return cls(**data)


class Runner(Protocol):
    """One runner: made for one repeat, then ``run`` per request, then ``close``."""

    info: Dict[str, Any]  # what it is (versions, command line, model info), for results.json

    def run(self, request: Request) -> RunResult:
        """Generate for one request; raises RuntimeError or ValueError on failure."""

    def close(self) -> None:
        """Free what the runner holds (models, processes, ROS nodes)."""


class MeasuredRunner(Runner, Protocol):
    """A runner as the parent holds it: also the peak RSS of its own process (a worker, a tool)."""

    peak_rss_mb: float
    base_rss_mb: Optional[float]  # with llama_cpp imported, before any model (None: not measured)


@dataclass
class Timeline:
    """Wall-clock marks of one generation, taken by the bench the same way for every runner."""

    start: float = field(default_factory=time.perf_counter)
    first: float = math.nan  # when the first non-empty output arrived
    first_tokens: int = 0  # tokens in that first output
    end: float = math.nan

    def output(self, n_tokens: int) -> None:
        """An output chunk of ``n_tokens`` tokens arrived (the first one sets TTFT)."""
        if n_tokens > 0 and math.isnan(self.first):
            self.first = time.perf_counter()
            self.first_tokens = n_tokens

    def finish(self) -> Tuple[float, float, int]:
        """(wall_s, ttft_s, n_first): RunResult's timing fields."""
        self.end = time.perf_counter()
        return self.end - self.start, self.first - self.start, self.first_tokens


def stats_dict(stats: Any) -> Dict[str, Any]:
    """A SpecStats as JSON-able data: its ``as_dict`` plus the raw per-position counters."""
    out = dict(stats.as_dict())
    out["accepted_at"] = list(stats.accepted_at)
    out["drafted_at"] = list(stats.drafted_at)
    return out


__all__ = ["MeasuredRunner", "Request", "RunResult", "Runner", "Timeline", "stats_dict"]
