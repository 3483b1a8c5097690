"""What the soak sends: the goals (valid ones of every kind, constrained ones whose text must
follow their JSON Schema, hostile ones the node must survive, and the invalid ones it must
refuse), where a goal is cancelled, the parameter values it sets, and when the lifecycle cycles
come. Pure data and seeded draws: the same seed gives the same run."""
from __future__ import annotations

import json
import random
from typing import Any, Callable, Dict, List, Sequence, Tuple

#: Cancel points of a cancelled goal: in the goal-response callback, right after acceptance (queued
#: or in prompt evaluation), mid-stream after k feedback messages, or after a random delay.
CANCEL_POINTS = ("response", "accepted", "stream", "delay")
COMPLETION_PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The robot moved to the kitchen. The robot picked up the cup. The robot",
    "Step 1: open the gripper.\nStep 2: move to the shelf.\nStep 3:",
    "List of rooms: kitchen, hallway, office, lab, kitchen, hallway,",
)
#: The goal whose greedy output must be the same at the end of the run as at the start.
GOLDEN = dict(prompt="def mul(a, b):\n    return a * b\n\ndef div(a, b):\n", max_tokens=24,
              temperature=0.0, seed=1, spec_mode="off")
#: The share of parameter sets that use an invalid value (which the node must refuse).
INVALID_PARAMETER_SHARE = 0.2
#: JSON Schemas of the valid constrained goals: small and bounded, so that
#: :data:`SCHEMA_MAX_TOKENS` lets the text complete; every such goal that ends ``stop`` must be
#: JSON valid for its schema.
SCHEMAS = (
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 99},
    {"enum": ["kitchen", "hallway", "office", "lab"]},
    {"type": "object", "properties": {"room": {"enum": ["kitchen", "lab"]},
                                      "steps": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["room", "steps"], "additionalProperties": False},
)
SCHEMA_MAX_TOKENS = 32
#: The prompt of the hostile goals (a plain completion: the constraint is the attack).
HOSTILE_PROMPT = "Write a short story about a robot:"
#: An ambiguous grammar whose parse states double with every character (39 bytes of rules): the
#: work per token of a grammar engine that keeps every stack grows without bound.
BOMB_GRAMMAR = 'root ::= x\nx ::= . x "1" | . x "2" | ""'
#: A recursive anyOf of two array schemas that share a prefix (the same growth through a schema).
RECURSIVE_ANYOF_SCHEMA = json.dumps(
    {"$defs": {"n": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/n"}},
                               {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 1}]}},
     "$ref": "#/$defs/n"})
#: 38 bytes that a converter writing one nested group per character expands into 20,000 levels.
LONG_STRING_SCHEMA = '{"type": "string", "maxLength": 20000}'
#: Default constraints that cannot serve a goal: each must be refused when set (the parameter
#: thread sets each once first, then among the other invalid values), never accepted and then
#: refusing every goal that sets no constraint of its own.
BAD_DEFAULT_CONSTRAINTS = (
    ("generation.grammar", "root ::= nope"),
    ("generation.json_schema", '{"type": "strin'),
    ("generation.grammar", BOMB_GRAMMAR + "\nbroken ::= ("),
)

#: (parameter name, a draw of its value) for the parameter thread.
ParameterDraws = List[Tuple[str, Callable[[], Any]]]


def invalid_goals(limits: Dict[str, int]) -> List[Tuple[str, Dict[str, Any]]]:
    """(kind, goal fields) of goals the node must reject, whatever its runtime parameters."""
    nan = float("nan")
    return [
        ("empty prompt", dict(prompt="")),
        ("temperature nan", dict(prompt="hi", temperature=nan)),
        ("temperature negative", dict(prompt="hi", temperature=-2.0)),
        ("top_p > 1", dict(prompt="hi", top_p=1.5)),
        ("top_k < -1", dict(prompt="hi", top_k=-5)),
        ("unknown spec_mode", dict(prompt="hi", spec_mode="warp" * 50)),
        ("seed < -1", dict(prompt="hi", seed=-7)),
        ("time_budget negative", dict(prompt="hi", time_budget=-1.0)),
        ("max_tokens over the limit", dict(prompt="hi", max_tokens=limits["max_tokens"] + 1)),
        ("empty stop string", dict(prompt="hi", stop=["ok", ""])),
        ("too many stop strings", dict(prompt="hi", stop=[f"s{i}" for i in range(limits["max_stop_strings"] + 1)])),
        ("stop string too long", dict(prompt="hi", stop=["x" * (limits["max_stop_length"] + 1)])),
        ("prompt over max_prompt_bytes", dict(prompt="é" * (limits["max_prompt_bytes"] // 2 + 1))),
        # over the limit even on the remote backend's lower-bound estimate (16 bytes per token)
        ("prompt over max_prompt_tokens",
         dict(prompt=" ".join(f"w{i}" for i in range(min(17 * limits["max_prompt_tokens"] // 4,
                                                         limits["max_prompt_bytes"] // 6))))),
        ("draft mode without a draft model", dict(prompt="hi", spec_mode="draft")),
    ]


def nested_grammar(max_bytes: int) -> str:
    """A grammar of nested groups as deep as ``max_bytes`` (limits.max_grammar_bytes) allows.

    >>> print(nested_grammar(20))
    root ::= (((("a"))))
    """
    depth = max(1, (max_bytes - len('root ::= "a"')) // 2)
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def hostile_goals(limits: Dict[str, int], max_tokens: int) -> List[Tuple[str, Dict[str, Any]]]:
    """(kind, goal fields) of goals whose constraint attacks the grammar engine: the node may
    refuse each with a reason or serve it, but must answer at once, end it within its budget and
    keep serving (the caller adds the budget)."""
    base = dict(prompt=HOSTILE_PROMPT, max_tokens=max_tokens, temperature=0.0)
    return [
        ("hostile: ambiguous grammar", dict(base, grammar=BOMB_GRAMMAR)),
        ("hostile: recursive anyOf schema", dict(base, json_schema=RECURSIVE_ANYOF_SCHEMA)),
        ("hostile: maxLength 20000 schema", dict(base, json_schema=LONG_STRING_SCHEMA)),
        ("hostile: grammar nested to the size limit", dict(base, grammar=nested_grammar(limits["max_grammar_bytes"]))),
    ]


def schema_goal(rng: random.Random) -> Tuple[str, Dict[str, Any]]:
    """(kind, goal fields) of a valid constrained goal (its schema as text in ``json_schema``)."""
    schema = rng.choice(SCHEMAS)
    return "json schema", dict(prompt=rng.choice(COMPLETION_PROMPTS), max_tokens=SCHEMA_MAX_TOKENS,
                               temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 1 << 30),
                               json_schema=json.dumps(schema))


def valid_goal(rng: random.Random, limits: Dict[str, int], max_tokens: int) -> Tuple[str, Dict[str, Any]]:
    """(kind, goal fields) of a goal the node must accept when active with room in its queue."""
    prompt = rng.choice(COMPLETION_PROMPTS)
    tokens = rng.randint(1, max_tokens)
    roll = rng.random()
    if roll < 0.35:
        return "greedy", dict(prompt=prompt, max_tokens=tokens, temperature=0.0, seed=1)
    if roll < 0.55:
        return "sampled", dict(prompt=prompt, max_tokens=tokens, temperature=0.8, top_p=0.95,
                               seed=rng.randint(0, 1 << 30))
    if roll < 0.65:
        return "chat", dict(prompt="Name a room.", system_prompt=rng.choice(["", "Be brief."]),
                            use_chat_template=True, max_tokens=tokens, temperature=0.0)
    if roll < 0.8:
        stops = rng.sample(["\n", "def", "The", ",", "Step", ")"], rng.randint(1, 4))
        return "stop list", dict(prompt=prompt, max_tokens=tokens, temperature=0.0, stop=stops)
    if roll < 0.9:
        words = max(8, int(limits["max_prompt_tokens"] * 0.4))
        return "long prompt", dict(prompt=" ".join(["kitchen hallway"] * (words // 2)), max_tokens=tokens,
                                   temperature=0.0)
    return "priority", dict(prompt=prompt, max_tokens=tokens, temperature=0.0,
                            priority=rng.randint(0, 3), preempt=rng.random() < 0.3)


def parameter_draws(rng: random.Random) -> Tuple[ParameterDraws, ParameterDraws]:
    """(valid, invalid): runtime parameters with draws of values the node must accept, and of
    values it must refuse with a reason."""
    valid = [("spec.mode", lambda: rng.choice(["off", "lookup", "auto"])),
             ("spec.draft_max", lambda: rng.choice([1, 2, 4, 8, 16])),
             ("spec.adaptive", lambda: rng.random() < 0.5),
             ("spec.verification", lambda: rng.choice(["exact", "rejection"])),
             ("feedback.min_period", lambda: rng.choice([0.0, 0.1])),
             ("queue.max_depth", lambda: rng.choice([2, 4, 8]))]
    invalid = [("spec.mode", lambda: "hyperdrive"), ("spec.draft_max", lambda: 999),
               ("spec.verification", lambda: "maybe"), ("spec.mode", lambda: "draft"),
               ("generation.max_tokens", lambda: 10 ** 7),
               ("target.n_ctx", lambda: 4096),  # configure-time: refused while configured
               *((name, lambda value=value: value) for name, value in BAD_DEFAULT_CONSTRAINTS)]
    return valid, invalid


def cycle_plan(rng: random.Random, cycles: Sequence[str], goals: int) -> List[Tuple[int, str]]:
    """(goal index, cycle) pairs in index order, at random indices below ``goals``. With fewer goals
    than cycles some are left out, never the remote phase (the clients keep sending until it ran).

    >>> cycle_plan(random.Random(0), ["deactivate", "cleanup", "remote"], 2)
    [(1, 'remote')]
    """
    marks = sorted(rng.sample(range(1, max(2, goals)), min(len(cycles), max(1, goals - 1))))
    labels = rng.sample(list(cycles), len(cycles))[:len(marks)]
    if "remote" in cycles and "remote" not in labels:
        labels[-1] = "remote"
    return list(zip(marks, labels))


# -- chat turns (GenerateChat) ---------------------------------------------------------------------
#: The tools of the soak's chat turns: a robot's skills with bounded strings and enums (a small
#: model writing free text inside a string would not stop within a goal's tokens).
CHAT_TOOLS: List[Dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "move_to", "description": "Drive to a named place.",
        "parameters": {"type": "object", "properties": {"place": {"enum": ["dock", "kitchen", "lab"]}},
                       "required": ["place"]}}},
    {"type": "function", "function": {
        "name": "pick", "description": "Pick an object up.",
        "parameters": {"type": "object", "properties": {"object": {"type": "string", "maxLength": 8},
                                                        "careful": {"type": "boolean"}},
                       "required": ["object", "careful"]}}},
    {"type": "function", "function": {
        "name": "say", "description": "Speak a short sentence.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
                       "required": ["text"]}}},
]
CHAT_TOOLS_JSON = json.dumps(CHAT_TOOLS)
CHAT_SYSTEM = "You are the task planner of a mobile robot. Call one skill at a time."
CHAT_TASKS = ("Bring the cup from the kitchen.", "Go to the lab and say hello.", "Pick up the red box carefully.",
              "Return to the dock.")


def chat_goal(rng: random.Random) -> Tuple[str, Dict[str, Any]]:
    """(kind, goal fields) of a valid chat turn: tools offered with ``tool_choice`` required, auto,
    none or a tool's name, one or several calls allowed, often map notes that make the turn longer
    than the sliding window, sometimes a follow-up turn that carries an earlier call and its result
    (messages as dicts: client.chat_goal)."""
    choice = rng.choice(["required", "auto", "none", "named"])
    named = rng.choice(["move_to", "pick", "say"])
    messages: List[Dict[str, Any]] = [{"role": "system", "content": CHAT_SYSTEM}]
    if rng.random() < 0.6:  # a map of the site: turns longer than the model's sliding window (512)
        notes = " ".join(f"Room {i} is next to room {i + 1}." for i in range(rng.randint(10, 90)))
        messages += [{"role": "user", "content": f"Map notes: {notes}"}, {"role": "assistant", "content": "Noted."}]
    messages.append({"role": "user", "content": rng.choice(CHAT_TASKS)})
    follow_up = rng.random() < 0.5
    if follow_up:
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [{"id": "call_1", "name": "move_to", "arguments": '{"place": "kitchen"}'}]},
                     {"role": "tool", "content": '{"arrived": true}', "tool_call_id": "call_1"},
                     {"role": "user", "content": rng.choice(["Now pick it up.", "Say what you see.", "Next."])}]
    fields = dict(messages=messages, tools=CHAT_TOOLS_JSON, tool_choice=named if choice == "named" else choice,
                  parallel_tool_calls=rng.random() < 0.3, max_tokens=rng.randint(24, 64),
                  temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randint(0, 1 << 30))
    return f"chat: {choice}" + (" follow-up" if follow_up else ""), fields


def malformed_chat_goals(limits: Dict[str, int]) -> List[Tuple[str, Dict[str, Any]]]:
    """(kind, goal fields) of chat turns the node must refuse (or end with an error)."""
    user = [{"role": "user", "content": "go"}]
    call = {"id": "c1", "name": "move_to", "arguments": '{"place": "dock"}'}
    outside_ref = json.dumps([{"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/properties/name"}}, "required": ["x"]}}}])
    return [
        ("chat invalid: no messages", dict(messages=[])),
        ("chat invalid: unknown role", dict(messages=[{"role": "robot", "content": "hi"}])),
        ("chat invalid: tool message without a call", dict(messages=user + [{"role": "tool", "content": "x"}])),
        ("chat invalid: tool result for no call", dict(messages=user + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "ok", "tool_call_id": "c9"}])),
        ("chat invalid: call arguments not JSON", dict(messages=[
            {"role": "assistant", "content": "", "tool_calls": [dict(call, arguments="{")]}], tools=CHAT_TOOLS_JSON)),
        ("chat invalid: tools not JSON", dict(messages=user, tools="[{")),
        ("chat invalid: $ref outside the parameters", dict(messages=user, tools=outside_ref, tool_choice="required")),
        ("chat invalid: tool_choice names no tool", dict(messages=user, tools=CHAT_TOOLS_JSON, tool_choice="fly")),
        ("chat invalid: required without tools", dict(messages=user, tool_choice="required")),
        ("chat invalid: grammar with tools", dict(messages=user, tools=CHAT_TOOLS_JSON, grammar='root ::= "x"')),
        ("chat invalid: more messages than prompt tokens",
         dict(messages=[{"role": "user", "content": ""}] * (limits["max_prompt_tokens"] + 1))),
        ("chat invalid: over max_prompt_bytes",
         dict(messages=[{"role": "user", "content": "x" * (limits["max_prompt_bytes"] + 1)}])),
    ]


def hostile_chat_goals(limits: Dict[str, int]) -> List[Tuple[str, Dict[str, Any]]]:
    """(kind, goal fields) of chat turns built to cost the goal check time (control-token-like text
    in a tool schema, many messages within the limits): refused or served, answered at once."""
    angle = json.dumps([{"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["<" * max(1, limits["max_grammar_bytes"] // 2)]}}}}}])
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""}
            for i in range(min(limits["max_prompt_tokens"], limits["max_prompt_bytes"] // 40) | 1)]
    return [("chat hostile: a schema string of '<'", dict(messages=[{"role": "user", "content": "go"}], tools=angle)),
            ("chat hostile: many empty messages", dict(messages=many))]


#: Reference requests of the fresh-engine check (soak/fresh.py): greedy, ``off``, prompt reuse as
#: configured; plain prompts the workload sends and some it never sends, and chat turns.
REFERENCE_PROMPTS = (COMPLETION_PROMPTS[1], COMPLETION_PROMPTS[2], "The weather today is",
                     "A recipe for pancakes:", "def mul(a, b):\n    return a * b\n")
REFERENCE_CHATS = (
    dict(messages=[{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": CHAT_TASKS[0]}],
         tools=CHAT_TOOLS_JSON, tool_choice="none"),
    dict(messages=[{"role": "user", "content": "Describe the kitchen in one sentence."}]),
)
