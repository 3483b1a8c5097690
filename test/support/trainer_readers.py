"""Readers of the datasets draft-head trainers take, written from their documented schemas (not from
gemma-spec-export-traffic's own check): SpecForge's conversation format (its data preparation page:
``{"id", "conversations": [{"role", "content"}...]}``, and its conversation parser's role rules, with
OpenAI's ``tool_calls`` / ``tool`` messages and a row's ``tools``, which it hands to the chat template)
and ShareGPT's ``from`` / ``value`` turns. Each raises AssertionError on a row the reader would refuse."""
from __future__ import annotations

import json
from typing import Any, Dict, Sequence


def check_tool_calls(calls: Any) -> None:
    """OpenAI's calls: ``{"id", "type": "function", "function": {"name", "arguments"}}``, the
    arguments a JSON object as text."""
    assert isinstance(calls, list) and calls
    for call in calls:
        assert call["type"] == "function" and isinstance(call["id"], str)
        assert isinstance(call["function"]["name"], str)
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def check_roles(roles: Sequence[str], tool_calls: Sequence[bool], *, tools: bool) -> None:
    """SpecForge's conversation rules (its GeneralParser): an optional system message first, then
    the user; an assistant after the user or a tool result; a tool result after an assistant's call
    or another result; the user after the assistant or a result; the reply last."""
    allowed = {"user", "assistant", "system"} | ({"tool"} if tools else set())
    assert set(roles) <= allowed, roles
    body = list(zip(roles, tool_calls))
    if body[0][0] == "system":
        body = body[1:]
    assert "system" not in [role for role, _ in body]
    assert body and body[0][0] == "user"
    follows = {"user": ("assistant", "tool"), "assistant": ("user", "tool"), "tool": ("assistant", "tool")}
    for (before, called), (role, _) in zip(body, body[1:]):
        assert before in follows[role], roles
        if role == "tool" and before == "assistant":
            assert called
    if not tools:
        assert [role for role, _ in body] == ["user", "assistant"] * (len(body) // 2), roles
    assert body[-1][0] == "assistant"


def specforge_reader_accepts(line: str) -> Dict[str, Any]:
    """SpecForge's conversation format: ``{"id", "conversations": [{"role", "content"}...]}`` (its
    data preparation page), with OpenAI's ``tool_calls`` / ``tool`` messages and a row's ``tools``
    (which its reader hands to the chat template)."""
    row = json.loads(line)
    assert isinstance(row, dict) and isinstance(row["id"], str) and row["id"]
    conversation = row["conversations"]
    assert isinstance(conversation, list) and conversation
    for message in conversation:
        assert isinstance(message["content"], str)
        assert set(message) <= {"role", "content", "tool_calls", "tool_call_id", "name"}
        if "tool_calls" in message:
            assert message["role"] == "assistant"
            check_tool_calls(message["tool_calls"])
        if message["role"] == "tool":
            assert message["tool_call_id"]
    check_roles([m["role"] for m in conversation], [bool(m.get("tool_calls")) for m in conversation], tools=True)
    for tool in row.get("tools", []):
        assert tool["type"] == "function" and isinstance(tool["function"]["name"], str)
    return row


def sharegpt_reader_accepts(line: str) -> Dict[str, Any]:
    """ShareGPT: ``{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}...]}``, human
    and gpt alternating after an optional system turn, no other fields."""
    row = json.loads(line)
    assert isinstance(row["id"], str) and row["id"] and set(row) == {"id", "conversations"}
    turns = row["conversations"]
    for turn in turns:
        assert set(turn) == {"from", "value"} and isinstance(turn["value"], str)
    names = {"system": "system", "human": "user", "gpt": "assistant"}
    check_roles([names[t["from"]] for t in turns], [False] * len(turns), tools=False)
    return row
