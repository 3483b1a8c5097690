"""What a soak run writes down: one :class:`GoalRecord` per goal, one :class:`Sample` of the server
process per sample period, and the :class:`SoakRun` the driver hands to the report."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class GoalRecord:
    """One goal as the soak client saw it."""

    index: int
    kind: str
    invalid: bool
    hostile: bool = False  # a constraint that attacks the grammar engine: refused or served, never fatal
    json_schema: str = ""  # the goal's schema: a text that ends ``stop`` must be valid for it
    cancel_point: str = ""
    accepted: Optional[bool] = None
    status: int = 0
    finish_reason: str = ""
    error: str = ""
    streamed: str = ""
    text: str = ""
    sent_at: float = 0.0
    result_at: float = 0.0
    cancel_at: float = 0.0
    cancel_accepted: Optional[bool] = None
    queue_wait: float = math.nan  # acceptance -> first feedback of the running goal (client side)
    accepted_at: float = 0.0
    started_at: float = 0.0
    lost: bool = False
    # the goal response never reached the client (ros2/rclpy#1123, goal side); the client found the
    # goal accepted in the action's status later: a client-side delay, not the server's answer time
    response_lost: bool = False
    # the result came only for a re-sent result request: the first one's response was dropped by
    # the client (ros2/rclpy#1123, result side; the driver logs "Ignoring unexpected result response")
    result_resent: bool = False
    remote: bool = False  # sent during the remote phase
    time_budget: float = 0.0  # the goal's time_budget (0 = none)
    step_ms: float = math.nan  # the result's verify time per target pass (server side)
    chunk_ms: float = math.nan  # the result's prompt time per evaluated n_batch chunk (server side)
    chat: bool = False  # a GenerateChat goal
    tools: str = ""  # a chat turn's tools (JSON): its calls must validate against them
    tool_choice: str = ""
    tool_calls: List[Tuple[str, str]] = field(default_factory=list)  # the result's (name, arguments)

    def streamed_matches(self) -> bool:
        """The feedback's text is the result's: a prompt's text, a chat turn's message content
        (trimmed: the message's text is, the stream keeps what it sent)."""
        if self.chat:
            return self.streamed.strip() == self.text.strip()
        return self.streamed == self.text


@dataclass
class Sample:
    t: float
    goals_done: int
    rss_mib: float
    threads: int
    open_files: int
    ngrams: int
    rss_anon_mib: float = math.nan  # heap and other private memory: where a leak shows
    rss_file_mib: float = math.nan  # mapped files (the GGUF's pages as they are touched)
    serving: bool = True  # False during a cleanup cycle or the remote phase (no model): not in the slopes
    conversations_mib: float = math.nan  # the conversation snapshots (bounded by chat.conversation_cache_mb)


@dataclass
class SoakRun:
    """Everything one run of the driver collected; :func:`~.report.build_report` judges it."""

    records: List[GoalRecord]  # every goal, the final ones (sent before SIGINT) last
    golden_start: str  # the greedy output of the golden goal at the start, and at the end
    golden_end: str
    exit_status: int  # the server's, after SIGINT
    seconds: float
    samples: List[Sample]
    param_results: List[Dict[str, Any]]  # name, value, valid, ok, reason of every parameter set
    transitions: List[Dict[str, Any]]  # transition, ok, seconds of every lifecycle transition
    serve_log: str  # the server's output
    remote: Optional[Any] = None  # the remote phase (remote_phase.RemotePhase), if it ran
    node_rejected: int = -1  # "requests rejected" on the node's /diagnostics at the end (-1: not read)
    fresh_checks: List[Dict[str, Any]] = field(default_factory=list)  # soak/fresh.py, at each point


@dataclass
class Report:
    config: Dict[str, Any]
    checks: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    metrics: Dict[str, Any] = field(default_factory=dict)
    samples: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check["pass"] for check in self.checks.values())
