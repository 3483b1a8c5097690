"""A conversation as a planner sends it: messages, the tools offered, and the rules of the next turn.

Plain data, checked where it is made (``ValueError`` with a reason a client can act on): the node
builds these from a GenerateChat goal, the CLI from a JSON file, the tests directly. The shapes are
OpenAI's chat shapes (roles, function tools, ``tool_choice``), the ones every agent framework
speaks (LangChain, ROSA, llama.cpp's server, vLLM).

Checks (each one a refusal at goal time, before anything is tokenized):

- roles are ``system``, ``user``, ``assistant`` or ``tool``; only an assistant message calls tools;
- a tool message answers a call: its ``tool_call_id`` names a call of an earlier assistant message
  (and its ``name``, when given, that call's tool);
- a call's arguments are a JSON object; tool names are OpenAI's (``[A-Za-z0-9_-]{1,64}``), unique;
- each tool's ``parameters`` is a JSON Schema of an object (checked with jsonschema's own
  meta-schema check, the API of jsonschema 3.2 and later) whose ``$ref`` values point inside it
  (``#`` or ``#/...``: the reply's grammar and its validation then read the same schema);
- ``tool_choice`` is ``auto``, ``none``, ``required`` or a tool's name, and needs tools unless it is
  auto or none.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

#: Roles a message may have.
ROLES: Tuple[str, ...] = ("system", "user", "assistant", "tool")
#: ``tool_choice`` values besides a tool's name ('' reads as auto).
TOOL_CHOICES: Tuple[str, ...] = ("auto", "none", "required")
#: OpenAI's rule for function names (it also keeps names free of any template's markup).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Characters of a client's text quoted in a refusal.
QUOTE_CHARS = 40


def _quote(text: str) -> str:
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def json_object(text: str, what: str) -> Dict[str, Any]:
    """``text`` parsed as a JSON object; ValueError naming ``what`` otherwise.

    >>> json_object('{"x": 1}', "arguments")
    {'x': 1}
    >>> json_object('[1]', "arguments")
    Traceback (most recent call last):
    ...
    ValueError: arguments must be a JSON object, not list
    """
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool: its id, the tool's name and the arguments as JSON text (an object)."""

    id: str
    name: str
    arguments: str = "{}"

    def __post_init__(self) -> None:
        if not TOOL_NAME.match(self.name):
            raise ValueError(f"tool call {self.id!r}: tool name {_quote(self.name)} must match "
                             f"{TOOL_NAME.pattern}")
        json_object(self.arguments, f"the arguments of tool call {self.id!r} ({self.name})")

    @property
    def arguments_object(self) -> Dict[str, Any]:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ChatMessage:
    """One message. ``tool_calls``: an assistant's calls; ``tool_call_id``: the call a tool message
    answers; ``name``: the speaker, or a tool message's tool."""

    role: str
    content: str = ""
    name: str = ""
    tool_call_id: str = ""
    tool_calls: Tuple[ToolCall, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {_quote(self.role)}: expected one of {', '.join(ROLES)}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message has tool_calls: only an assistant message calls tools")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message without tool_call_id: it must name the call it answers")
        if self.tool_call_id and self.role != "tool":
            raise ValueError(f"a {self.role} message has a tool_call_id: only a tool message answers a call")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: OpenAI's ``{"type": "function", "function": {...}}``."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> Dict[str, Any]:
        """The tool as a chat template takes it (OpenAI's shape)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


#: The deepest nesting of objects and arrays a tool's schema may have: jsonschema's meta-schema
#: check recurses several frames per level and exhausted Python's stack between 160 and 200 levels
#: (an object property nests 2 levels), where the goal would be refused with a RecursionError's
#: words. Real tool schemas nest well under 20.
MAX_SCHEMA_NESTING = 64


def json_nesting(value: Any, limit: int) -> int:
    """Levels of objects and arrays in a parsed JSON value, counted without recursion; counting
    stops past ``limit``.

    >>> json_nesting({"a": [1, {"b": []}]}, 32), json_nesting(3, 32)
    (4, 0)
    """
    deepest, pending = 0, [(value, 1)]
    while pending and deepest <= limit:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in children)
    return deepest


def check_schema(schema: Mapping[str, Any], what: str) -> None:
    """ValueError if ``schema`` is not a valid JSON Schema (jsonschema's meta-schema check, by the
    draft the schema names, else the newest the installed jsonschema knows) or nests deeper than
    :data:`MAX_SCHEMA_NESTING`."""
    import jsonschema  # noqa: WPS433  a runtime dependency, imported where used

    if json_nesting(schema, MAX_SCHEMA_NESTING) > MAX_SCHEMA_NESTING:
        raise ValueError(f"{what}: objects and arrays nested deeper than {MAX_SCHEMA_NESTING} levels")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"{what} is not a valid JSON Schema: {exc.message}"
                         + (f" (at {where})" if where else "")) from None


def check_references(schema: Mapping[str, Any], what: str) -> None:
    """ValueError unless every ``$ref`` of ``schema`` is a JSON pointer into ``schema`` itself
    (``#``, ``#/$defs/point``...) that leads to a schema there: a reference to another document, to
    an anchor, or to nothing would be read one way by the grammar and another (or not at all) by
    validation.

    >>> check_references({"$defs": {"p": {"type": "number"}}, "properties": {"x": {"$ref": "#/$defs/p"}}}, "s")
    >>> check_references({"properties": {"x": {"$ref": "#/properties/name"}}}, "the parameters")
    Traceback (most recent call last):
    ...
    ValueError: the parameters: $ref '#/properties/name' points to nothing in the parameters themselves
    """
    stack: List[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):  # (a dict there is a property named "$ref")
            if not (ref == "#" or ref.startswith("#/")):
                raise ValueError(f"{what}: $ref {_quote(ref)} is not a reference within the "
                                 "parameters themselves ('#' or '#/...'); other documents and anchors "
                                 "are not supported")
            if not isinstance(json_pointer(schema, ref[1:]), dict):
                raise ValueError(f"{what}: $ref {_quote(ref)} points to nothing in the parameters themselves")
        stack.extend(value for key, value in node.items() if key not in ("const", "enum", "default", "examples"))


def json_pointer(document: Any, pointer: str) -> Any:
    """The value at a JSON pointer (RFC 6901, as a URI fragment: percent-escapes decoded), None
    where it points to nothing.

    >>> json_pointer({"a": [{"b~c": 1}]}, "/a/0/b~0c"), json_pointer({"a": 1}, "/b")
    (1, None)
    """
    from urllib.parse import unquote  # noqa: WPS433

    node = document
    for raw in (pointer.split("/")[1:] if pointer else []):
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def parse_tools(text: str) -> Tuple[Tool, ...]:
    """The tools of a goal (a JSON array of OpenAI function tools; '' = none), checked.

    >>> [t.name for t in parse_tools('[{"type": "function", "function": {"name": "stop"}}]')]
    ['stop']
    >>> parse_tools('[{"type": "function", "function": {"name": "go", "parameters": {"type": 3}}}]')
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the parameters of tool 'go' is not a valid JSON Schema: 3 is not valid under any of ...
    """
    if not text.strip():
        return ()
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"tools is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError("tools must be a JSON array of {\"type\": \"function\", \"function\": {...}}")
    tools = tuple(_tool(entry, i) for i, entry in enumerate(entries))
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"tools: names must be unique; given more than once: {', '.join(duplicates)}")
    return tools


def _tool(entry: Any, index: int) -> Tool:
    if not isinstance(entry, dict) or entry.get("type", "function") != "function" \
            or not isinstance(entry.get("function"), dict):
        raise ValueError(f"tools[{index}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    function = entry["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"tools[{index}]: the function's name must match {TOOL_NAME.pattern}")
    description = function.get("description", "") or ""
    if not isinstance(description, str):
        raise ValueError(f"tool {name!r}: description must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ValueError(f"tool {name!r}: parameters must be a JSON Schema object")
    check_schema(parameters, f"the parameters of tool {name!r}")
    check_references(parameters, f"the parameters of tool {name!r}")
    if parameters.get("type", "object") != "object":
        raise ValueError(f"tool {name!r}: parameters must describe an object (\"type\": \"object\"), "
                         f"not {parameters.get('type')!r}")
    return Tool(name, description, parameters)


@dataclass(frozen=True)
class Conversation:
    """The messages so far and what the next (assistant) turn may do.

    ``tool_choice``: ``auto`` (text or calls), ``none`` (text; the tools are still shown: see
    :attr:`shown`), ``required`` (one call at least) or a tool's name (a call of that tool).
    ``parallel_tool_calls``: several calls in one turn allowed, else at most one.
    """

    messages: Tuple[ChatMessage, ...]
    tools: Tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = False

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("messages is empty: a conversation needs at least one message")
        choice = self.tool_choice or "auto"
        names = [tool.name for tool in self.tools]
        if choice not in TOOL_CHOICES and choice not in names:
            raise ValueError(f"tool_choice {_quote(choice)}: expected auto, none, required or the name of "
                             f"one of the tools ({', '.join(names) or 'none given'})")
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice required but no tools are given")
        object.__setattr__(self, "tool_choice", choice)
        _check_tool_messages(self.messages)

    @property
    def shown(self) -> Tuple[Tool, ...]:
        """The tools the template shows the model: every tool given, whatever ``tool_choice`` says,
        so that a conversation's prompt keeps its prefix from turn to turn (its KV is reused); the
        turn's grammar holds the reply to ``tool_choice``."""
        return self.tools

    @property
    def offered(self) -> Tuple[Tool, ...]:
        """The tools the reply may call this turn (none with tool_choice none)."""
        if self.tool_choice == "none":
            return ()
        if self.tool_choice in TOOL_CHOICES:
            return self.tools
        return tuple(tool for tool in self.tools if tool.name == self.tool_choice)

    @property
    def must_call(self) -> bool:
        """The turn must be a call (tool_choice required or a name)."""
        return self.tool_choice not in ("auto", "none")

    def tool(self, name: str) -> Optional[Tool]:
        return next((tool for tool in self.tools if tool.name == name), None)


def _check_tool_messages(messages: Sequence[ChatMessage]) -> None:
    """Every tool message answers a call of an earlier assistant message."""
    calls: Dict[str, str] = {}
    for i, message in enumerate(messages):
        for call in message.tool_calls:
            calls[call.id] = call.name
        if message.role != "tool":
            continue
        called = calls.get(message.tool_call_id)
        if called is None:
            raise ValueError(f"messages[{i}]: a tool message answers tool_call_id "
                             f"{_quote(message.tool_call_id)}, which no earlier assistant message called")
        if message.name and message.name != called:
            raise ValueError(f"messages[{i}]: a tool message named {_quote(message.name)} answers a call "
                             f"of {called!r}")


def conversation_from_json(data: Mapping[str, Any]) -> Conversation:
    """A Conversation from OpenAI-style JSON (``{"messages": [...], "tools": [...], ...}``), as the
    CLI reads a ``--chat`` file: message ``content`` may be null, a call's ``arguments`` an object
    or its JSON text, and the call's tool under ``function`` as OpenAI writes it."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ValueError("the chat needs \"messages\": a JSON array")
    tools = data.get("tools") or []
    return Conversation(tuple(_message(m, i) for i, m in enumerate(messages)),
                        parse_tools(json.dumps(tools)), str(data.get("tool_choice") or "auto"),
                        bool(data.get("parallel_tool_calls", False)))


def _message(entry: Any, index: int) -> ChatMessage:
    if not isinstance(entry, dict):
        raise ValueError(f"messages[{index}] must be an object with role and content")
    calls: List[ToolCall] = []
    for j, call in enumerate(entry.get("tool_calls") or []):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"messages[{index}].tool_calls[{j}] must be an object")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(ToolCall(str(call.get("id") or f"call_{index}_{j}"), str(function.get("name", "")),
                              arguments))
    return ChatMessage(str(entry.get("role", "")), str(entry.get("content") or ""),
                       str(entry.get("name") or ""), str(entry.get("tool_call_id") or ""), tuple(calls))


__all__ = ["ChatMessage", "Conversation", "ROLES", "TOOL_CHOICES", "Tool", "ToolCall", "check_references",
           "MAX_SCHEMA_NESTING", "check_schema", "json_nesting",
           "conversation_from_json", "json_object", "parse_tools"]
