"""The multi-request traces as requests: what :mod:`.trace` times and :mod:`.trace_replay` replays.

A trace is a list of requests sent in order to one engine (one server, one llama-lookup cache), so
whatever a drafter learns from a request's output it may use for the next ones:

- ``planner``: the planner suite's system prompt (prompts/planner.yaml) with each of
  :data:`~.trace_prompts.PLANNER_INSTRUCTIONS`; constrained, every request carries the suite's plan
  schema (config/schemas/robot_plan.schema.json) as its ``json_schema``;
- ``agent``: the turns of :func:`~.trace_prompts.agent_turns` (no schema);
- ``suites``: every prompt of the single-prompt suites (prompts/*.yaml), once each in the bench's
  order, free text, as one bench repeat sends them to one engine (what the history of the earlier
  prompts' outputs does to the next ones: the single-prompt check of a drafter that learns).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import yaml

from .config import find_data_dir, load_suite, load_suites
from .trace_prompts import PLANNER_INSTRUCTIONS, agent_turns

TRACES = ("planner", "agent", "suites")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    id: str
    prompt: str
    json_schema: str = ""  # the JSON Schema text the output must follow ('' = free text)


def _planner_suite_file(prompts_dir: Optional[Path]) -> Path:
    folder = prompts_dir or find_data_dir("prompts")
    if folder is None or not (folder / "planner.yaml").is_file():
        raise ValueError("the planner suite (prompts/planner.yaml) was not found: pass --prompts-dir")
    return folder / "planner.yaml"


def trace_requests(trace: str, constrained: bool = False,
                   prompts_dir: Optional[Path] = None) -> List[TraceRequest]:
    """The requests of ``trace`` (one of :data:`TRACES`) in order; ``constrained``: with the plan
    schema (the planner trace only)."""
    if trace in ("agent", "suites") and constrained:
        raise ValueError(f"the {trace} trace has no schema: it runs unconstrained only")
    if trace == "agent":
        return [TraceRequest(name, prompt) for name, prompt in agent_turns()]
    if trace == "suites":
        folder = prompts_dir or find_data_dir("prompts")
        if folder is None:
            raise ValueError("the prompt suites (prompts/*.yaml) were not found: pass --prompts-dir")
        return [TraceRequest(f"{p.suite}/{p.id}", p.text) for suite in load_suites(folder) for p in suite.prompts]
    if trace != "planner":
        raise ValueError(f"unknown trace {trace!r}: expected one of {', '.join(TRACES)}")
    path = _planner_suite_file(prompts_dir)
    system = str(yaml.safe_load(path.read_text(encoding="utf-8"))["system"])
    schema = ""
    if constrained:
        schema_path = load_suite(path).json_schema_path
        if schema_path is None:
            raise ValueError(f"{path} names no json_schema_file")
        schema = schema_path.read_text(encoding="utf-8")
    return [TraceRequest(f"plan-{number:02d}", f"{system}\n\nInstruction: {text}\nPlan:", schema)
            for number, text in enumerate(PLANNER_INSTRUCTIONS, start=1)]
