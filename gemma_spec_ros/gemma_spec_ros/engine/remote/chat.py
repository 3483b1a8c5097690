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
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..chat.conversation import TOOL_CHOICES, ChatMessage, Conversation
from ..chat.reply import AssistantReply, assistant_reply
from ..chat.syntax import TAGGED_JSON_CALLS, CallSyntax, Parsed
from .http import RemoteError


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


class ToolCallDeltas:
    """The ``delta.tool_calls`` fragments of a stream, by their ``index``: the first fragment of a
    call brings its name (and id), later ones pieces of its arguments' JSON text.

    >>> calls = ToolCallDeltas()
    >>> calls.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "a", "function": {
    ...     "name": "go", "arguments": '{"to": '}}]}}]})
    True
    >>> calls.add({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"dock"}'}}]}}]})
    True
    >>> calls.parsed("")
    Parsed(content='', calls=(('go', {'to': 'dock'}),), error='')
    """

    def __init__(self) -> None:
        self._calls: Dict[int, Dict[str, str]] = {}

    def add(self, chunk: Mapping[str, Any]) -> bool:
        """Take one chunk's tool-call fragments (a chunk without any is fine); whether it had any."""
        choices = chunk.get("choices") or []
        delta = choices[0].get("delta") if choices and isinstance(choices[0], dict) else None
        fragments = delta.get("tool_calls") if isinstance(delta, dict) else None
        if not fragments:
            return False
        if not isinstance(fragments, list):
            raise RemoteError(f"the server sent tool_calls that are not a list: {str(fragments)[:200]!r}")
        for fragment in fragments:
            function = fragment.get("function") if isinstance(fragment, dict) else None
            index = fragment.get("index", len(self._calls)) if isinstance(fragment, dict) else None
            if not isinstance(function, dict) or not isinstance(index, int):
                raise RemoteError(f"the server sent a tool call fragment of an unknown shape: {str(fragment)[:200]!r}")
            call = self._calls.setdefault(index, {"name": "", "arguments": ""})
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
        return True

    def parsed(self, content: str) -> Parsed:
        """The calls put together (in index order) with the streamed text; ``error`` names the first
        call whose arguments are not a JSON object."""
        calls: List[Tuple[str, Dict[str, Any]]] = []
        for index in sorted(self._calls):
            call = self._calls[index]
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError as exc:
                return Parsed(content.strip(), tuple(calls), f"the server's call of {call['name']!r} has "
                              f"arguments that are not JSON ({exc})")
            if not isinstance(arguments, dict):
                return Parsed(content.strip(), tuple(calls), f"the server's call of {call['name']!r} has "
                              "arguments that are not a JSON object")
            calls.append((call["name"], arguments))
        return Parsed(content.strip(), tuple(calls))

    def reply(self, conversation: Conversation, content: str, ended: str = "stop") -> AssistantReply:
        """The turn's message: the streamed text and the calls that validate."""
        return assistant_reply(conversation, self.parsed(content), ended)


__all__ = ["ToolCallDeltas", "chat_fields", "conversation_text", "openai_message"]
