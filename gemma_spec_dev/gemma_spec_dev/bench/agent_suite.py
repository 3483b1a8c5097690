"""The agent-loop suite: a planner agent's conversations with the robot's skills as tools.

Each task is one conversation of :data:`TURNS` turns: a system prompt and the person's request, then
turns in which the model calls one skill (``tool_choice`` required) and gets the skill's result
from :class:`World`, a deterministic stand-in for the robot's executive, and a last turn in which
it reports in text (``tool_choice`` none). The bench runs the tasks' turns interleaved (task 1's
turn 1, task 2's turn 1, ..., task 1's turn 2, ...), as several planners sharing the node would, so
a follow-up turn finds another conversation's KV in the cache unless the engine kept its own.

The embedded Gemma 3 270M is a base model without a chat template: the suite gives the engine and
llama-server the same template explicitly (:data:`TEMPLATE`, this project's own text): Gemma 3's
turns, the tools as JSON in ``<tools>`` in the first user turn, and calls as JSON in
``<tool_call>`` tags (the syntax llama-server's Hermes-style handler and the engine's tagged-JSON
syntax both read).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Tuple

#: Turns per task: (TURNS - 1) turns that must call a skill, then one that answers in text.
TURNS = 6

PLACES = ["kitchen_table", "kitchen_counter", "sink", "fridge", "cupboard", "living_room_table",
          "sofa", "dock"]
OBJECT_CLASSES = ["cup", "plate", "bottle", "book", "towel", "apple"]
ARTICULATED = ["fridge_door", "cupboard_door", "drawer_cutlery", "dishwasher_door"]


def _tool(name: str, description: str, properties: Dict[str, Any], required: Sequence[str]) -> Dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


#: The robot's skills as OpenAI function tools.
SKILLS: List[Dict[str, Any]] = [
    _tool("navigate", "Drive the base to a named place.", {"place": {"type": "string", "enum": PLACES}}, ["place"]),
    _tool("detect", "Find objects of a class in view of the head camera; returns their ids.",
          {"object_class": {"type": "string", "enum": OBJECT_CLASSES}}, ["object_class"]),
    _tool("pick", "Grasp a detected object.", {
        "object_id": {"type": "string", "maxLength": 24},
        "grasp": {"type": "string", "enum": ["top", "side", "handle", "pinch"]}}, ["object_id", "grasp"]),
    _tool("place", "Put the held object down at a place.", {
        "object_id": {"type": "string", "maxLength": 24}, "place": {"type": "string", "enum": PLACES},
        "pose_hint": {"type": "string", "enum": ["center", "left", "right", "inside"]}},
          ["object_id", "place"]),
    _tool("open", "Open a door, drawer or lid.", {"target": {"type": "string", "enum": ARTICULATED}}, ["target"]),
    _tool("close", "Close a door, drawer or lid.", {"target": {"type": "string", "enum": ARTICULATED}}, ["target"]),
    _tool("say", "Speak a short sentence to the people in the room.",
          {"text": {"type": "string", "maxLength": 80}}, ["text"]),
]

SYSTEM = ("You are the task planner of Rover, a mobile manipulator robot in a home kitchen and living "
          "room. You reach the person's goal by calling Rover's skills one at a time: after each call "
          "you get the skill's result and choose the next call. Use only the places, object classes "
          "and doors the skills list. When the task is done, tell the person in one short sentence.")

TASKS: List[str] = [
    "Bring a cup from the kitchen counter to the living room table.",
    "Put the apple from the kitchen table into the fridge.",
    "Clear the plate from the living room table to the sink.",
    "Fetch a bottle from the cupboard and hand it over at the sofa.",
]

#: A chat template for Gemma 3's vocabulary with tools (see the module docstring).
TEMPLATE = r"""
{{- bos_token -}}
{%- set ns = namespace(system='', first=true) -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] | trim -%}{%- endif -%}
{%- if tools -%}
    {%- set ns.system = ns.system + '\n\nYou can call these tools (each one: its name, what it does, the JSON Schema of its arguments):\n<tools>\n' -%}
    {%- for tool in tools -%}{%- set ns.system = ns.system + (tool['function'] | tojson) + '\n' -%}{%- endfor -%}
    {%- set ns.system = ns.system + '</tools>\nTo call a tool, answer with\n<tool_call>\n{"name": <the tool name>, "arguments": <its arguments as a JSON object>}\n</tool_call>' -%}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'user' -%}
        {{- '<start_of_turn>user\n' -}}
        {%- if ns.first and ns.system -%}{{- ns.system + '\n\n' -}}{%- endif -%}
        {%- set ns.first = false -%}
        {{- message['content'] | trim -}}{{- '<end_of_turn>\n' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<start_of_turn>model\n' -}}
        {%- if message['content'] -%}{{- message['content'] | trim -}}{%- endif -%}
        {%- for call in message['tool_calls'] or [] -%}
            {{- '<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<end_of_turn>\n' -}}
    {%- elif message['role'] == 'tool' -%}
        {{- '<start_of_turn>user\n<tool_response>\n' + (message['content'] | trim) + '\n</tool_response><end_of_turn>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""


@dataclass
class World:
    """A deterministic stand-in for the robot's executive: each skill's result as JSON text."""

    holding: str = ""
    location: str = "dock"
    counter: int = 0
    log: List[str] = field(default_factory=list)

    def run(self, name: str, arguments: Mapping[str, Any]) -> str:
        self.log.append(name)
        if name == "navigate":
            self.location = str(arguments.get("place", self.location))
            result: Dict[str, Any] = {"arrived": self.location}
        elif name == "detect":
            self.counter += 1
            result = {"objects": [f"{arguments.get('object_class', 'thing')}_{self.counter}"]}
        elif name == "pick":
            self.holding = str(arguments.get("object_id", ""))
            result = {"holding": self.holding}
        elif name == "place":
            result = {"placed": self.holding, "at": arguments.get("place", self.location)}
            self.holding = ""
        elif name in ("open", "close"):
            result = {name + "ed" if name == "open" else "closed": arguments.get("target", "")}
        else:
            result = {"done": True}
        return json.dumps(result)


def task_messages(task: str, few_shot: bool = False) -> List[Dict[str, Any]]:
    """The first messages of a task's conversation (OpenAI's shape): the system prompt, with
    ``few_shot`` an example task done by calls (:data:`EXAMPLE`), and the task."""
    return [{"role": "system", "content": SYSTEM}, *(EXAMPLE if few_shot else []), {"role": "user", "content": task}]


def _example_call(call_id: str, name: str, arguments: Dict[str, Any], result: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [{"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": name, "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}]


#: An example task done by calls, for a model that answers in text where it may call (a base
#: model under ``tool_choice`` auto): before the task, it shows the model the calls it may make.
EXAMPLE: List[Dict[str, Any]] = [
    {"role": "user", "content": "Put the towel from the sofa onto the kitchen counter."},
    *_example_call("ex1", "navigate", {"place": "sofa"}, {"arrived": "sofa"}),
    *_example_call("ex2", "detect", {"object_class": "towel"}, {"objects": ["towel_0"]}),
    *_example_call("ex3", "pick", {"object_id": "towel_0", "grasp": "pinch"}, {"holding": "towel_0"}),
    *_example_call("ex4", "navigate", {"place": "kitchen_counter"}, {"arrived": "kitchen_counter"}),
    *_example_call("ex5", "place", {"object_id": "towel_0", "place": "kitchen_counter"},
                   {"placed": "towel_0", "at": "kitchen_counter"}),
    {"role": "assistant", "content": "The towel is on the kitchen counter."},
]


def turn_choice(turn: int) -> str:
    """``tool_choice`` of a task's turn (0-based): a skill call, then the answer in text."""
    return "required" if turn < TURNS - 1 else "none"


def schedule(n_tasks: int, turns: int = TURNS) -> List[Tuple[int, int]]:
    """(task, turn) in the order the bench runs them: turn by turn, tasks interleaved.

    >>> schedule(2, 2)
    [(0, 0), (1, 0), (0, 1), (1, 1)]
    """
    return [(task, turn) for turn in range(turns) for task in range(n_tasks)]


__all__ = ["EXAMPLE", "SKILLS", "SYSTEM", "TASKS", "TEMPLATE", "TURNS", "World", "schedule", "task_messages", "turn_choice"]
