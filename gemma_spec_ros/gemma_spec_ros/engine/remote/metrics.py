"""Acceptance (tau) of a remote request, never invented: the server's counters, attributed.

- llama-server's per-request ``timings`` carry ``draft_n`` and ``draft_n_accepted`` (drafted and
  accepted tokens: the acceptance rate), but not the number of verify passes that tau needs.
- Its ``/metrics`` (``--metrics``) and vLLM's ``/metrics`` have the counters
  ``*:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` (``_total``).
  :class:`TauAttribution` reads them before and after each request; the deltas are this request's
  only when the server's generated-token counter moved by exactly this request's tokens (no other
  client generated in between), otherwise the request's tau stays unknown. The rolling stats take
  the server's deltas since configure: the server-wide tau over all its clients (the server's
  speculation serves them all).
- A server that reports none of these leaves every acceptance figure unknown (NaN), as local ``off``.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional

from ..stats import SpecStats
from .http import RemoteError, server_count, server_seconds

#: Attempts to see the server's counters include a finished request (they update after the stream).
METRICS_SETTLE_TRIES = 5
METRICS_SETTLE_SLEEP = 0.02
_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens", "generation_tokens")
#: Server counter names -> ours (llama-server calls generated tokens ``tokens_predicted``).
_COUNTER_ALIASES = {"tokens_predicted": "generation_tokens"}

Counters = Dict[str, float]


def parse_prometheus(text: str) -> Counters:
    """The counters this module reads, summed over label sets, from Prometheus text.

    Names lose their ``vllm:`` / ``llamacpp:`` prefix and ``_total`` suffix. A sample that is not a
    finite number >= 0 (``NaN``, ``+Inf``, a negative) is no counter reading: it is left out.

    >>> parse_prometheus('# HELP x\\nvllm:spec_decode_num_drafts_total{model_name="m"} 3.0\\n'
    ...                  'vllm:spec_decode_num_drafts_total{model_name="n"} 2\\n'
    ...                  'llamacpp:tokens_predicted_total 7\\n')
    {'spec_decode_num_drafts': 5.0, 'generation_tokens': 7.0}
    """
    out: Counters = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if "}" in rest:
            rest = rest.split("}", 1)[1]
        name = name.split(":", 1)[-1]
        if name.endswith("_total"):
            name = name[:-len("_total")]
        name = _COUNTER_ALIASES.get(name, name)
        if name not in _COUNTERS:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if not (math.isfinite(value) and value >= 0):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> Optional[int]:
    """How far counter ``name`` moved; None if either reading lacks it.

    >>> delta({"generation_tokens": 12.0}, {"generation_tokens": 5.0}, "generation_tokens")
    7
    """
    if name not in after or name not in before:
        return None
    return int(round(after[name] - before[name]))


def fill_stats(stats: SpecStats, chunks: int, first_at: float, last_at: float,
               usage: Mapping[str, Any], timings: Mapping[str, Any]) -> None:
    """Counts and rates of a request from what the server reported, else from the chunks; the
    prompt tokens the server took from its cache from ``usage.prompt_tokens_details.cached_tokens``
    (OpenAI's field, llama-server and vLLM send it) or llama-server's ``timings.cache_n``.
    RemoteError if a reported number is not a count or a duration (:func:`~.http.server_count`).

    >>> stats = SpecStats()
    >>> fill_stats(stats, 3, 0.0, 0.5, {"completion_tokens": 3, "prompt_tokens": 800,
    ...                                 "prompt_tokens_details": {"cached_tokens": 768}}, {})
    >>> stats.num_prompt_tokens, stats.num_prompt_tokens_reused, stats.num_step_tokens
    (800, 768, 2)
    """
    usage, timings = _as_mapping(usage, "usage"), _as_mapping(timings, "timings")
    generated = (_count(usage, "completion_tokens", "usage") or _count(timings, "predicted_n", "timings")
                 or chunks)
    stats.num_generated_tokens = generated
    prompt = _count(usage, "prompt_tokens", "usage")
    if prompt is None and "prompt_n" in timings:
        prompt = (_count(timings, "prompt_n", "timings") or 0) + (_count(timings, "cache_n", "timings") or 0)
    if prompt is not None:
        stats.num_prompt_tokens = prompt
    details = _as_mapping(usage.get("prompt_tokens_details") or {}, "usage.prompt_tokens_details")
    cached = _count(details, "cached_tokens", "usage.prompt_tokens_details")
    if cached is None:
        cached = _count(timings, "cache_n", "timings")
    if cached is not None:
        stats.num_prompt_tokens_reused = cached
    if "prompt_ms" in timings:
        stats.prompt_time = server_seconds(timings["prompt_ms"], "timings.prompt_ms", 1e-3)
    # Decode rate as local mode defines it: tokens after the first / time after the first.
    stats.num_step_tokens = max(0, stats.num_generated_tokens - 1)
    stats.generation_time = (last_at - first_at) if chunks > 1 else 0.0
    if "draft_n" in timings:
        set_acceptance(stats, 0, _count(timings, "draft_n", "timings") or 0,
                       _count(timings, "draft_n_accepted", "timings") or 0)


def draft_counts(timings: Mapping[str, Any]) -> Optional[tuple]:
    """(drafted, accepted) of llama-server's per-request ``timings``; None without them."""
    if "draft_n" not in timings:
        return None
    return (_count(timings, "draft_n", "timings") or 0, _count(timings, "draft_n_accepted", "timings") or 0)


def _as_mapping(value: Any, what: str) -> Mapping[str, Any]:
    """The server's ``usage`` / ``timings`` object ({} when absent); RemoteError if it is no object."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RemoteError(f"the server reported {what} as {type(value).__name__}, not an object")
    return value


def _count(fields: Mapping[str, Any], name: str, where: str) -> Optional[int]:
    """``fields[name]`` checked as a count; None when absent or null."""
    value = fields.get(name)
    return None if value is None else server_count(value, f"{where}.{name}")


def set_acceptance(stats: SpecStats, drafts: int, drafted: int, accepted: int) -> None:
    """Counters the server reported, in place of ours (``drafts`` 0 = not reported: tau unknown).

    The server gives totals, not the per-draft events :meth:`SpecStats.observe_draft` records, so
    the totals are set directly; acceptance per position stays empty (unknown)."""
    stats.num_drafts = max(0, drafts)
    stats.num_draft_tokens = max(0, drafted)
    stats.num_accepted_tokens = max(0, min(accepted, drafted))


def _set_deltas(stats: SpecStats, after: Mapping[str, float], before: Mapping[str, float]) -> bool:
    """The acceptance counters moved between two readings, set on ``stats``; False if any is missing."""
    drafts = delta(after, before, "spec_decode_num_drafts")
    drafted = delta(after, before, "spec_decode_num_draft_tokens")
    accepted = delta(after, before, "spec_decode_num_accepted_tokens")
    if drafts is None or drafted is None or accepted is None:
        return False
    set_acceptance(stats, drafts, drafted, accepted)
    return True


class TauAttribution:
    """The server's acceptance counters: per request (before/after deltas, cross-checked with the
    request's ``timings``) and since configure (for the rolling stats). ``read`` returns the
    server's counters, or None when it has none (or did not answer)."""

    def __init__(self, read: Callable[[], Optional[Counters]]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self.available = False  # the server exposes the counters (set once its kind is known)
        self._baseline: Optional[Counters] = None
        self._last: Optional[Counters] = None
        self._source = "none"

    @property
    def source(self) -> str:
        """Where tau comes from: none | server /metrics | server timings [+ /metrics]."""
        with self._lock:
            return self._source

    def observe(self) -> None:
        """A periodic reading (the prober's): the baseline at the first, the latest at every one."""
        if not self.available:
            return
        counters = self._read()
        if counters is None:
            return
        with self._lock:
            self._note(counters)
            if self._source == "none":
                self._source = "server /metrics"

    def _note(self, counters: Counters) -> None:
        """Take a reading as the latest (under the lock). A counter that went down means the server
        restarted (its counters start again from 0): the baseline moves down by the last reading,
        so the counts since configure keep what came before the restart and add what comes after.

        >>> tau = TauAttribution(lambda: None)
        >>> for reading in ({"spec_decode_num_drafts": 5.0}, {"spec_decode_num_drafts": 9.0},
        ...                 {"spec_decode_num_drafts": 2.0}):   # restarted after 9
        ...     tau._note(reading)
        >>> tau._last["spec_decode_num_drafts"] - tau._baseline["spec_decode_num_drafts"]
        6.0
        """
        baseline, last = self._baseline, self._last
        if baseline is None:
            self._baseline = dict(counters)
        elif last is not None and any(counters[name] < last[name] for name in counters if name in last):
            self._baseline = {name: baseline.get(name, 0.0) - last.get(name, 0.0) for name in counters}
        self._last = dict(counters)

    def before_request(self) -> Optional[Counters]:
        """The reading a request's deltas start from (None without counters)."""
        return self._read() if self.available else None

    def attribute(self, stats: SpecStats, before: Optional[Counters], timings: Mapping[str, Any]) -> None:
        """Per-request tau from /metrics deltas, when they can only be this request's."""
        if "draft_n" in timings:
            with self._lock:
                self._source = "server timings" + (" + /metrics" if self.available else "")
        if before is None:
            return
        mine = stats.num_generated_tokens
        for _ in range(METRICS_SETTLE_TRIES):
            after = self._read()
            if after is None:
                return
            moved = delta(after, before, "generation_tokens")
            if moved is not None and moved >= mine:
                break
            time.sleep(METRICS_SETTLE_SLEEP)
        with self._lock:
            self._note(after)
        if moved != mine:  # another client generated meanwhile (or the server restarted): not attributable
            return
        reported = draft_counts(timings)
        if reported is not None:
            if (delta(after, before, "spec_decode_num_draft_tokens"),
                    delta(after, before, "spec_decode_num_accepted_tokens")) != reported:
                return
        if _set_deltas(stats, after, before) and "draft_n" not in timings:
            with self._lock:
                self._source = "server /metrics"

    def apply_since_configure(self, rolling: SpecStats) -> None:
        """The server's counters since the first reading, in place of ``rolling``'s."""
        with self._lock:
            baseline, last = self._baseline, self._last
        if baseline is not None and last is not None:
            _set_deltas(rolling, last, baseline)


__all__ = ["METRICS_SETTLE_TRIES", "Counters", "TauAttribution", "delta", "fill_stats",
           "parse_prometheus", "set_acceptance"]
