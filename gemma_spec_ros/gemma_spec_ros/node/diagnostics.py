"""Formatting of the engine's statistics for ROS: the /diagnostics statuses (the SpecStats
message is :func:`gemma_spec_ros.node.messages.spec_stats_msg`).

The node formats the engine's stats; it never recomputes them. The only arithmetic here is over
things the node itself measures (request latency percentiles, counters) and
:meth:`SpecStats.merge` of recent requests into a window.

Status levels of ``<node>: speculative decoding`` (the convention rqt_robot_monitor reads):

- ERROR: the last configure failed (the message says why; cleared by a configure that succeeds),
  or, while active, the last request failed in the engine (cleared by the next one that does not).
- OK with the state as the message while the node is not active ("unconfigured", "inactive", or a
  transition such as "configuring"): a node that was deliberately left inactive is not a fault.
- WARN: speculation measured slower than plain decoding over the window
  (``measured_speedup`` < :data:`SLOWER_THAN_PLAIN`), the policy predicts no gain
  (``predicted_speedup`` < 1, i.e. tau below break-even), the goal queue is full, or (backend
  remote) the inference server is unreachable.
- OK otherwise.

The node never publishes STALE: to diagnostic_aggregator and rqt_robot_monitor STALE means "no
fresh status from this node" (the shipped analyzer's ``timeout``), i.e. a node that died or hangs;
a node that publishes is alive, whatever its state.

With ``backend: remote`` the status also carries the remote engine's key-values (server url,
reachable, RTT, which backend served, where tau comes from); ``mode`` reads "set by the server".
"""
from __future__ import annotations

import collections
import math
import socket
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from ..engine.stats import SpecStats
from . import spec_status_name

#: Below this measured speedup the status warns. 5% under 1.0 so that timing noise of a policy that
#: has switched speculation off (speedup ~1) does not flap the level.
SLOWER_THAN_PLAIN = 0.95
#: Finished requests kept for the latency percentiles and the windowed stats.
WINDOW = 50

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile, q in [0, 100]; NaN for no values.

    >>> percentile([4.0, 1.0, 3.0, 2.0], 50), percentile([4.0, 1.0, 3.0, 2.0], 95)
    (2.0, 4.0)
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def rss_bytes() -> int:
    """Resident set size of this process from /proc/self/status (0 where unavailable)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class RequestLog:
    """What the node measures about requests: counts, recent latencies, recent stats."""

    ok: int = 0
    failed: int = 0
    cancelled: int = 0
    timeout: int = 0  # ended by their time budget
    preempted: int = 0  # stopped by an urgent goal
    rejected: int = 0
    last_failed: bool = False
    last_error: str = ""
    last_rejection: str = ""
    internal_errors: int = 0  # exceptions caught in callbacks, failed cache saves
    last_internal_error: str = ""
    latencies: Deque[float] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    queue_waits: Deque[float] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    ttfts: Deque[float] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    recent: Deque[SpecStats] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    def record(self, finish_reason: str, latency: float, stats: Optional[SpecStats], error: str = "") -> None:
        """A request ended with ``finish_reason`` after ``latency`` seconds from acceptance."""
        if finish_reason == "error":
            self.failed += 1
            self.last_error = error
        elif finish_reason == "cancelled":
            self.cancelled += 1
        elif finish_reason == "timeout":
            self.timeout += 1
        elif finish_reason == "preempted":
            self.preempted += 1
        else:
            self.ok += 1
        self.last_failed = finish_reason == "error"
        self.latencies.append(latency)
        if stats is not None:
            self.queue_waits.append(stats.queue_wait)
            if not math.isnan(stats.time_to_first_token):
                self.ttfts.append(stats.time_to_first_token)
        if stats is not None and stats.num_generated_tokens:
            self.recent.append(stats)

    def fault(self, text: str) -> None:
        """An internal error outside a request (a callback raised, a cache save failed)."""
        self.internal_errors += 1
        self.last_internal_error = text

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.last_rejection = reason

    def window_stats(self) -> Optional[SpecStats]:
        """The recent requests' stats merged (SpecStats.merge), or None before the first one."""
        if not self.recent:
            return None
        window = SpecStats()
        for stats in self.recent:
            window.merge(stats)
        return window


@dataclass(frozen=True)
class NodeView:
    """What the status formatter needs to know about the node at one instant."""

    node_name: str
    hardware_id: str
    lifecycle_state: str  # unconfigured | configuring | inactive | active | deactivating | ...
    queue_depth: int
    queue_max_depth: int
    running: bool
    spec: Optional[Any]  # the engine's SpecConfig, None when unconfigured
    model_info: Mapping[str, Any]
    configure_error: str = ""
    backend: Mapping[str, Any] = field(default_factory=dict)  # the engine's status() key-values
    dispatcher: str = ""  # the thread that starts goals: running | stopped | '' (unconfigured)


def hardware_id(configured: str) -> str:
    """The configured id, or the host name."""
    return configured or socket.gethostname()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


#: Characters of a key-value shown on /diagnostics (values may quote a client's strings, and they
#: are republished every period).
MAX_VALUE_CHARS = 512


def _kv(pairs: Iterable[Tuple[str, Any]]) -> List[KeyValue]:
    return [KeyValue(key=k, value=_fmt(v)[:MAX_VALUE_CHARS]) for k, v in pairs]


def spec_status(view: NodeView, log: RequestLog, rolling: Optional[SpecStats]) -> DiagnosticStatus:
    """``<node>: speculative decoding``: level, message and the key-values operators watch.

    ``rolling`` is the engine's lifetime stats (for mode, K, tau, acceptance); tokens/s, the
    speedup and the prompt tokens reused / evaluated come from the window of recent requests
    (summed); TTFT and queue wait are p50 / p95 over that window.
    """
    window = log.window_stats()
    current = rolling or SpecStats()
    recent = window or SpecStats()
    latencies = list(log.latencies)
    level, message = _spec_level(view, log, window)
    mode = current.spec_mode if rolling is not None else (view.spec.mode if view.spec else "")
    remote = view.backend.get("backend") == "remote"
    configured_mode = "set by the server" if remote else (view.spec.mode if view.spec else mode)
    pairs = [
        ("state", view.lifecycle_state),
        ("mode", configured_mode),
        ("mode in effect", mode),
        ("verification", view.spec.verification if view.spec else ""),
        ("tau (mean acceptance length)", current.mean_acceptance_length),
        ("acceptance rate", current.acceptance_rate),
        ("acceptance histogram", current.acceptance_histogram),  # [i]: drafts that kept i tokens
        *((f"{kind} tokens drafted / accepted", f"{drafted} / {accepted}")
          for kind, (drafted, accepted) in current.tokens_by_kind().items()),
        ("grammar rows without logits", current.num_grammar_sole_rows),
        ("grammar cut tokens", current.num_grammar_cut_tokens),
        ("K (draft_max)", view.spec.draft_max if view.spec else 0),
        ("draft length last", current.draft_last),
        ("tokens/s", recent.tokens_per_second),
        ("TTFT p50 ms", percentile(list(log.ttfts), 50) * 1e3),
        ("TTFT p95 ms", percentile(list(log.ttfts), 95) * 1e3),
        ("queue wait p50 ms", percentile(list(log.queue_waits), 50) * 1e3),
        ("queue wait p95 ms", percentile(list(log.queue_waits), 95) * 1e3),
        ("latency p50 s", percentile(latencies, 50)),
        ("latency p95 s", percentile(latencies, 95)),
        ("prompt tokens reused (window)", recent.num_prompt_tokens_reused),
        ("prompt tokens evaluated (window)", recent.num_prompt_tokens - recent.num_prompt_tokens_reused),
        ("measured speedup", recent.measured_speedup),
        ("predicted speedup", current.predicted_speedup),
        ("queue depth", view.queue_depth),
        ("queue max depth", view.queue_max_depth),
        ("running", view.running),
        ("goal dispatcher", view.dispatcher),
        ("requests ok", log.ok),
        ("requests failed", log.failed),
        ("requests cancelled", log.cancelled),
        ("requests timeout", log.timeout),
        ("requests preempted", log.preempted),
        ("requests rejected", log.rejected),
        ("last rejection", log.last_rejection),
        ("last error", log.last_error),
        ("internal errors", log.internal_errors),
        ("last internal error", log.last_internal_error),
        ("RSS MiB", rss_bytes() / 2**20),
        *view.backend.items(),  # ends with "dynamic cache n-grams"
    ]
    return DiagnosticStatus(level=level, name=spec_status_name(view.node_name),
                            message=message, hardware_id=view.hardware_id, values=_kv(pairs))


def _spec_level(view: NodeView, log: RequestLog, window: Optional[SpecStats]) -> Tuple[bytes, str]:
    if view.configure_error and view.lifecycle_state == "unconfigured":
        return ERROR, f"configure failed: {view.configure_error}"
    if view.lifecycle_state != "active":
        return OK, view.lifecycle_state
    if view.dispatcher == "stopped" or view.backend.get("scheduler") == "stopped":
        which = "goal dispatcher" if view.dispatcher == "stopped" else "scheduler of requests at once"
        return ERROR, f"the {which} stopped: no goal can run (cleanup and configure restart it)"
    if log.last_failed:
        return ERROR, f"last request failed: {log.last_error}"
    warnings = []
    speculating = view.spec is not None and view.spec.mode != "off"
    if speculating and window is not None and window.measured_speedup < SLOWER_THAN_PLAIN:
        warnings.append(f"speculation slower than plain decoding (x{window.measured_speedup:.2f})")
    if speculating and window is not None and window.predicted_speedup < 1.0:
        warnings.append(f"tau below break-even (predicted x{window.predicted_speedup:.2f})")
    if view.backend.get("server reachable") is False:
        fallback = view.backend.get("fallback") == "local"
        warnings.append(f"inference server unreachable ({view.backend.get('server error', '')})"
                        + ("; serving from the local model" if fallback else ""))
    if view.queue_depth >= max(1, view.queue_max_depth):
        warnings.append(f"queue backing up ({view.queue_depth}/{view.queue_max_depth} waiting)")
    if warnings:
        return WARN, "; ".join(warnings)
    return OK, "serving" if view.running else "ready"


def models_status(view: NodeView) -> DiagnosticStatus:
    """``<node>: models``: paths, sizes, n_gpu_layers, vocabulary, from ``engine.model_info()``;
    ERROR after a failed configure (with its reason), OK "no models loaded" otherwise."""
    if view.model_info:
        level, message = OK, "loaded"
    elif view.configure_error and view.lifecycle_state == "unconfigured":
        level, message = ERROR, f"not loaded: {view.configure_error}"
    else:
        level, message = OK, "no models loaded"
    pairs = list(_flatten(view.model_info))
    return DiagnosticStatus(level=level, name=f"{view.node_name}: models", message=message,
                            hardware_id=view.hardware_id, values=_kv(pairs))


def _flatten(info: Mapping[str, Any], prefix: str = "") -> Iterable[Tuple[str, Any]]:
    """Nested dicts as dotted keys: {"target": {"n_vocab": 5}} -> ("target.n_vocab", 5)."""
    for key, value in info.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, name + ".")
        elif value is not None:
            yield name, value


def diagnostic_array(stamp: Time, statuses: Sequence[DiagnosticStatus]) -> DiagnosticArray:
    msg = DiagnosticArray(status=list(statuses))
    msg.header.stamp = stamp
    return msg


def key_values(status: DiagnosticStatus) -> Dict[str, str]:
    """A status's key-values as a dict (for clients and tests)."""
    return {kv.key: kv.value for kv in status.values}
