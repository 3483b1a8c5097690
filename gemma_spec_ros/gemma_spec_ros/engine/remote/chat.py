"""A chat turn with tools on an OpenAI-compatible server: the request's fields and the streamed calls.

The server renders the conversation with its own template and parses the model's calls itself
(llama.cpp's ``llama-server --jinja``, vLLM with a tool parser); this room sends the conversation in
OpenAI's shape (:func:`chat_fields`: messages, tools, ``tool_choice``, ``parallel_tool_calls``) and
puts the streamed ``delta.tool_calls`` fragments back together (:class:`ToolCallDeltas`). The calls
then go through the same validation as the local engine's
(:func:`~gemma_spec_ros.engine.chat.reply.validated`): a call of a tool not offered, or whose
arguments do not follow its schema, is left out with the reason, whatever the server let through.

A turn that must call, on a llama-server whose template writes calls as JSON in ``<tool_call>``
tags: llama.cpp's generic tool grammar for such templates lets the reply open with free text
before its first call, ``tool_choice`` required or not (its autoparser's rule is "any text up to
``<tool_call>``, then calls"), and a model that rambles on runs out of tokens without a call. The
turn is sent with the assistant's reply opened by the call's tag (llama-server continues a final
assistant message): the server's grammar holds the call from its first token. Without parallel
calls the closing tag ends the turn (a stop string; the server still parses the call). Gemma 4's
own syntax needs none of this: llama.cpp's Gemma 4 handler starts a required turn with the call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..chat.conversation import TOOL_CHOICES, ChatMessage, Conversation, json_nesting
from ..chat.reply import AssistantReply, assistant_reply
from ..chat.syntax import TAGGED_JSON_CALLS, CallSyntax, Parsed
from .http import RemoteError

#: The deepest nesting of a server's call arguments taken: what reads them after this room
#: recurses per level (the call's own JSON check, schema validation, the node's messages), so
#: arguments nested just under Python's recursion limit, which json.loads here still read, raised
#: ValueError a few frames deeper (ToolCall's check) instead of being left out with the reason. A
#: tool's arguments nest a few levels.
MAX_ARGUMENT_NESTING = 32


def chat_fields(conversation: Conversation, syntax: Optional[CallSyntax] = None) -> Dict[str, Any]:
    """The body fields of the turn: ``messages`` and, with tools, ``tools``, ``tool_choice`` and
    ``parallel_tool_calls``. A named tool is sent as that tool alone with ``required`` (the same
    turn; llama-server takes only the string values of ``tool_choice``). ``syntax``: the call
    syntax of the llama-server's template, if known: a turn that must call in tagged JSON is sent
    opened by the tag, with the closing tag as a stop string when one call is allowed (see the
    module docstring).

    >>> from gemma_spec_ros.engine.chat import ChatMessage, Conversation, Tool
    >>> body = chat_fields(Conversation((ChatMessage("user", "Stop."),), (Tool("halt"), Tool("go")), "halt"))
    >>> [t["function"]["name"] for t in body["tools"]], body["tool_choice"], body["parallel_tool_calls"]
    (['halt'], 'required', False)
    >>> body = chat_fields(Conversation((ChatMessage("user", "Report."),), (Tool("halt"), Tool("go")), "none"))
    >>> [t["function"]["name"] for t in body["tools"]], body["tool_choice"]
    (['halt', 'go'], 'none')
    >>> body = chat_fields(Conversation((ChatMessage("user", "Stop."),), (Tool("halt"),), "required"),
    ...                    TAGGED_JSON_CALLS)
    >>> body["messages"][-1], body["stop"]
    ({'role': 'assistant', 'content': '<tool_call>'}, ['</tool_call>'])
    """
    body: Dict[str, Any] = {"messages": [openai_message(m) for m in conversation.messages]}
    choice = conversation.tool_choice
    if conversation.tools:
        named = choice not in TOOL_CHOICES
        body["tools"] = [tool.as_openai() for tool in (conversation.offered if named else conversation.tools)]
        body["tool_choice"] = "required" if named else choice
        body["parallel_tool_calls"] = conversation.parallel_tool_calls
        if conversation.must_call and syntax is TAGGED_JSON_CALLS:
            body["messages"].append({"role": "assistant", "content": syntax.opener})
            if not conversation.parallel_tool_calls:
                body["stop"] = [syntax.closer]
    return body


def conversation_text(conversation: Conversation) -> str:
    """The clients' text of a turn, for counting its tokens (a lower bound of the templated
    prompt's): every message's content and calls, and the tools offered, one per line.

    >>> from gemma_spec_ros.engine.chat import ChatMessage, Conversation
    >>> conversation_text(Conversation((ChatMessage("system", "Plan."), ChatMessage("user", "Go."))))
    'Plan.\\nGo.'
    """
    lines = [m.content for m in conversation.messages if m.content]
    lines += [f"{c.name} {c.arguments}" for m in conversation.messages for c in m.tool_calls]
    lines += [json.dumps(tool.as_openai()) for tool in conversation.shown]
    return "\n".join(lines)


def openai_message(message: ChatMessage) -> Dict[str, Any]:
    """A message in OpenAI's wire shape (a call's arguments as JSON text, content null when an
    assistant message only calls tools)."""
    entry: Dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        entry["name"] = message.name
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["content"] = message.content or None
        entry["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}}
                               for c in message.tool_calls]
    return entry


#: The times a stream's first call is read for completeness (ToolCallDeltas.first_complete).
MAX_CLOSING_CHECKS = 64


@dataclass(frozen=True)
class _CallPieces:
    """One streamed call's name and arguments as their fragments, joined once at the end: joining
    at every fragment copied the arguments so far each time (10,000 fragments of 256 bytes took
    ~5 s, 40,000 took ~100 s), a cost a server sets by how finely it splits."""

    name: List[str] = field(default_factory=list)
    arguments: List[str] = field(default_factory=list)


class ToolCallDeltas:
    """The ``delta.tool_calls`` fragments of a stream, by their ``index``: the first fragment of a
    call brings its name (and id), later ones pieces of its arguments' JSON text. Every field is
    checked as it comes: one of another type ends the request with a :class:`RemoteError` that
    names it, never an internal error.

    >>> calls = ToolCallDeltas()
    >>> calls.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "a", "function": {
    ...     "name": "go", "arguments": '{"to": '}}]}}]})
    True
    >>> calls.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"dock"}'}}]}}]})
    True
    >>> calls.parsed("")
    Parsed(content='', calls=(('go', {'to': 'dock'}),), error='', cut=False)
    >>> calls.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": 5}}]}}]})
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gemma_spec_ros.engine.remote.http.RemoteError: the server sent tool_calls[0].function.name as int (5), ...
    """

    def __init__(self) -> None:
        self._calls: Dict[int, _CallPieces] = {}
        self._closing_checks = 0

    @property
    def opened(self) -> int:
        """Calls the stream has begun."""
        return len(self._calls)

    def first_complete(self) -> bool:
        """Whether the first call's arguments are a whole JSON object already (a turn that may make
        one call ends there). Read only when its last fragment closes a brace, a bounded number of
        times: a server sets how finely it splits the arguments."""
        if not self._calls:
            return False
        first = self._calls[min(self._calls)]
        if not first.name or not first.arguments or not first.arguments[-1].rstrip().endswith("}"):
            return False
        if self._closing_checks >= MAX_CLOSING_CHECKS:
            return False
        self._closing_checks += 1
        try:
            return isinstance(json.loads("".join(first.arguments)), dict)
        except (ValueError, RecursionError):
            return False

    def keep_first(self) -> None:
        """Only the first call stays (a turn that may make one call got more)."""
        first = min(self._calls)
        self._calls = {first: self._calls[first]}

    def add(self, chunk: Mapping[str, Any]) -> bool:
        """Take one chunk's tool-call fragments (a chunk without any is fine); whether it had any."""
        choices = chunk.get("choices") or []
        delta = choices[0].get("delta") if choices and isinstance(choices[0], dict) else None
        fragments = delta.get("tool_calls") if isinstance(delta, dict) else None
        if not fragments:
            return False
        if not isinstance(fragments, list):
            raise RemoteError(f"the server sent tool_calls that are not a list: {str(fragments)[:200]!r}")
        for position, fragment in enumerate(fragments):
            where = f"tool_calls[{position}]"
            _check(fragment, where, dict, "an object", required=True)
            index = fragment.get("index")
            _check(index, f"{where}.index", int, "a whole number >= 0")
            if index is not None and index < 0:
                raise RemoteError(f"the server sent {where}.index={index}, expected a whole number >= 0")
            for key in ("id", "type"):
                _check(fragment.get(key), f"{where}.{key}", str, "a string")
            function = fragment.get("function")
            _check(function, f"{where}.function", dict, "an object")
            function = function or {}
            name, arguments = function.get("name"), function.get("arguments")
            _check(name, f"{where}.function.name", str, "a string")
            _check(arguments, f"{where}.function.arguments", str, "a string (JSON text)")
            call = self._calls.setdefault(len(self._calls) if index is None else index, _CallPieces())
            if name:
                call.name.append(name)
            if arguments:
                call.arguments.append(arguments)
        return True

    def parsed(self, content: str) -> Parsed:
        """The calls put together (in index order) with the streamed text; ``error`` names each
        call whose arguments are not a JSON object (left out, as the local engine's parser leaves
        out an unreadable call); ``cut``: the last call is one (a cut by max_tokens reads so)."""
        calls: List[Tuple[str, Dict[str, Any]]] = []
        errors: List[str] = []
        last = max(self._calls, default=None)
        for index in sorted(self._calls):
            name, text = "".join(self._calls[index].name), "".join(self._calls[index].arguments)
            try:
                arguments = json.loads(text or "{}")
                problem = "" if isinstance(arguments, dict) else "that are not a JSON object"
                if not problem and json_nesting(arguments, MAX_ARGUMENT_NESTING) > MAX_ARGUMENT_NESTING:
                    problem = f"nested more than {MAX_ARGUMENT_NESTING} levels deep"
            except ValueError as exc:
                problem = f"that are not JSON ({exc})"
            except RecursionError:  # json's decoder recurses per level, and the server sets the depth
                problem = f"nested more than {MAX_ARGUMENT_NESTING} levels deep"
            if problem:
                errors.append(f"the server's call of {name!r} has arguments {problem}")
                if index == last:
                    return Parsed(content.strip(), tuple(calls), "; ".join(errors), cut=True)
                continue
            calls.append((name, arguments))
        return Parsed(content.strip(), tuple(calls), "; ".join(errors))

    def reply(self, conversation: Conversation, content: str, ended: str = "stop") -> AssistantReply:
        """The turn's message: the streamed text and the calls that validate."""
        return assistant_reply(conversation, self.parsed(content), ended)


def _check(value: Any, where: str, kind: type, expected: str, required: bool = False) -> None:
    """RemoteError naming ``where`` unless ``value`` is a ``kind`` or, when not ``required``, None
    (absent or null). A bool is no number here, though Python counts it as an int."""
    if (value is None and not required) or (isinstance(value, kind) and not isinstance(value, bool)):
        return
    raise RemoteError(f"the server sent {where} as {type(value).__name__} ({str(value)[:100]}), "
                      f"expected {expected}: not an OpenAI-compatible tool call")


__all__ = ["MAX_ARGUMENT_NESTING", "ToolCallDeltas", "chat_fields", "conversation_text", "openai_message"]
