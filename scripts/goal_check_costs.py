"""Time the node's goal-time checks on hostile inputs within the default byte limits.

What a goal callback runs before it answers (node/goal_kinds.py): the size bounds, the goal ->
request mapping (a chat goal's messages and tools parsed and checked), then the engine's
``count_prompt`` (the chat template rendered, the prompt tokenized, the constraint compiled) and
``check_request``. Each input below is built to cost those steps time (many messages, control-token
text, deep or wide schemas, long runs of one character); each is timed on the embedded model with
the agent suite's chat template (the node's chat.template_path in the tests and the soak), with the
node's default limits. Prints one line per input (seconds, and whether the goal was accepted or
refused with what reason) and the slowest; ``--json`` writes them too.

    .venv/bin/python scripts/goal_check_costs.py [--model PATH] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace as Goal
from typing import Any, Dict, List, Tuple

from gemma_spec_dev.bench.agent_suite import TEMPLATE
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.node.chat_messages import chat_request_from_goal
from gemma_spec_ros.node.messages import GoalRejected, check_input_bounds, request_from_goal
from gemma_spec_ros.node.parameters import PARAMETERS

DEFAULTS = {spec.name: spec.default for spec in PARAMETERS}
KIB = 1 << 10


def message(role: str, content: str = "", calls: Tuple[Any, ...] = ()) -> Goal:
    return Goal(role=role, content=content, name="", tool_call_id="", tool_calls=list(calls))


def chat(messages: List[Goal], tools: str = "", tool_choice: str = "") -> Goal:
    return Goal(messages=messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
                max_tokens=16, temperature=0.0, top_p=0.0, top_k=-1, seed=1, stop=[], spec_mode="",
                time_budget=0.0, grammar="", json_schema="")


def plain(prompt: str, **fields: Any) -> Goal:
    base = dict(prompt=prompt, system_prompt="", use_chat_template=False, max_tokens=16, temperature=0.0,
                top_p=0.0, top_k=-1, seed=1, stop=[], spec_mode="", time_budget=0.0, grammar="", json_schema="")
    return Goal(**{**base, **fields})


def tools_of(*parameters: Dict[str, Any]) -> str:
    return json.dumps([{"type": "function", "function": {"name": f"t{i}", "parameters": p}}
                       for i, p in enumerate(parameters)])


def nested_object(depth: int) -> Dict[str, Any]:
    schema: Dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(depth: int) -> Dict[str, Any]:
    schema: Dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return schema


def inputs() -> List[Tuple[str, bool, Goal]]:
    """(name, chat, goal) of each hostile input, within limits.max_prompt_bytes / max_grammar_bytes."""
    limit, grammar = DEFAULTS["limits.max_prompt_bytes"], DEFAULTS["limits.max_grammar_bytes"]
    most = min(DEFAULTS["limits.max_prompt_tokens"], limit // 32)  # messages within both bounds
    return [
        (f"{most - 1} empty messages, alternating", True,
         chat([message("user" if i % 2 == 0 else "assistant") for i in range(most - 1)])),
        (f"{most - 1} empty user messages", True, chat([message("user") for _ in range(most - 1)])),
        ("a tool enum value of '<' (max_grammar_bytes)", True,
         chat([message("user", "go")], tools_of({"type": "object", "properties": {"x": {"enum": ["<" * (grammar - 200)]}}}))),
        ("a message of '<' (max_prompt_bytes)", True, chat([message("user", "<" * (limit - 100))])),
        ("a message of control-token text", True, chat([message("user", "<start_of_turn>" * (limit // 16 - 8))])),
        ("a message of newlines", True, chat([message("user", "\n" * (limit - 100))])),
        ("a tool nested 100 objects deep", True,
         chat([message("user", "go")], tools_of(nested_object(100)), "required")),
        ("500 tools", True, chat([message("user", "go")], tools_of(*[{"type": "object"}] * 500), "required")),
        ("a tool enum of 4,000 values", True,
         chat([message("user", "go")], tools_of({"type": "object", "properties": {"x": {"enum": list(range(4000))}}}),
              "required")),
        ("a prompt of '<' (max_prompt_bytes)", False, plain("<" * (limit - 100))),
        ("a prompt of '<' in the chat template", False, plain("<" * (limit - 100), use_chat_template=True)),
        ("a json_schema nested 60 arrays deep", False, plain("go", json_schema=json.dumps(nested_arrays(60)))),
        ("a grammar of 2,000 alternatives", False,
         plain("go", grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(2000)))),
    ]


def goal_check(engine: Engine, is_chat: bool, goal: Goal) -> str:
    """What the goal callback runs; 'accepted' or the refusal's reason."""
    try:
        if is_chat:
            request = chat_request_from_goal(goal, DEFAULTS)
        else:
            check_input_bounds(goal, DEFAULTS)
            request = request_from_goal(goal, DEFAULTS)
        counted = engine.count_prompt(request)
        if counted.n_tokens > DEFAULTS["limits.max_prompt_tokens"]:
            return f"refused: {counted.n_tokens} prompt tokens"
        engine.check_request(request, counted.n_tokens)
        return "accepted"
    except (GoalRejected, ValueError) as exc:
        return f"refused: {str(exc)[:90]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cache = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")
    parser.add_argument("--model", default=str(cache / "models" / "gemma-3-270m-q4_k_m.gguf"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        template = Path(folder) / "chat.jinja"
        template.write_text(TEMPLATE)
        config = EngineConfig(target=ModelConfig(args.model, n_ctx=DEFAULTS["target.n_ctx"]),
                              spec=SpecConfig(mode="off"), chat=ChatConfig(template_path=str(template)))
        with Engine(config, calibrate=False) as engine:
            goal_check(engine, True, chat([message("user", "warm up")], tools_of({"type": "object"}), "required"))
            rows = []
            for name, is_chat, goal in inputs():
                times, outcome = [], ""
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    outcome = goal_check(engine, is_chat, goal)
                    times.append(time.perf_counter() - started)
                rows.append({"input": name, "seconds": min(times), "outcome": outcome})
                print(f"{min(times):7.3f} s  {name}: {outcome}", flush=True)
    slowest = max(rows, key=lambda row: row["seconds"])
    print(f"slowest: {slowest['input']} ({slowest['seconds']:.3f} s, fastest of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "slowest": slowest}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
