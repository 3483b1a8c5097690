"""GenerateChat goals and results <-> the chat layer (node/chat_messages.py), on the real generated
message types: refusals name the message, sizes are bounded before parsing, a reply's calls and
reasons reach the result."""
from __future__ import annotations

import doctest

import pytest
from builtin_interfaces.msg import Time
from gemma_spec_msgs.action import GenerateChat
from gemma_spec_msgs.msg import ChatMessage, ToolCall

from gemma_spec_ros.engine.chat import AssistantReply
from gemma_spec_ros.engine.chat import ToolCall as Call
from gemma_spec_ros.node import chat_messages
from gemma_spec_ros.node.chat_messages import (chat_result, check_chat_bounds, conversation_from_goal)
from gemma_spec_ros.node.messages import GoalRejected
from support.chat import SKILLS_JSON

LIMITS = {"limits.max_prompt_bytes": 4096, "limits.max_grammar_bytes": 2048, "limits.max_prompt_tokens": 1536}


def test_module_doctests() -> None:
    assert doctest.testmod(chat_messages).failed == 0


def goal(*messages: ChatMessage, **fields: object) -> GenerateChat.Goal:
    return GenerateChat.Goal(messages=list(messages), **fields)


def test_a_goal_becomes_a_conversation() -> None:
    call = ToolCall(id="c1", name="move_to", arguments='{"place": "dock"}')
    conversation = conversation_from_goal(goal(
        ChatMessage(role="user", content="go"), ChatMessage(role="assistant", tool_calls=[call]),
        ChatMessage(role="tool", content="ok", tool_call_id="c1"), tools=SKILLS_JSON, tool_choice="required",
        parallel_tool_calls=True))
    assert conversation.messages[1].tool_calls[0].arguments_object == {"place": "dock"}
    assert conversation.must_call and conversation.parallel_tool_calls and len(conversation.tools) == 3
    assert conversation_from_goal(goal(ChatMessage(role="user", content="hi"))).tool_choice == "auto"


@pytest.mark.parametrize("make, reason", [
    (lambda: goal(), "messages is empty"),
    (lambda: goal(ChatMessage(role="user", content="a"), ChatMessage(role="wizard", content="b")),
     "messages[1]: unknown role 'wizard'"),
    (lambda: goal(ChatMessage(role="user", content="a"), ChatMessage(role="tool", content="b")),
     "messages[1]: a tool message without tool_call_id"),
    (lambda: goal(ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name="go", arguments="{")])),
     "messages[0]: the arguments of tool call 'c' (go) is not valid JSON"),
    (lambda: goal(ChatMessage(role="user", content="a"), tools='[{"type": "function", "function": '
                  '{"name": "go", "parameters": {"type": "object", "required": "x"}}}]'),
     "the parameters of tool 'go' is not a valid JSON Schema"),
    (lambda: goal(ChatMessage(role="user", content="a"), tools=SKILLS_JSON, tool_choice="dance"),
     "tool_choice 'dance'"),
])
def test_bad_goals_are_refused_with_the_reason(make: object, reason: str) -> None:
    with pytest.raises(GoalRejected, match=reason.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        conversation_from_goal(make())


def test_sizes_are_bounded_before_parsing() -> None:
    check_chat_bounds(goal(ChatMessage(role="user", content="x" * 100)), LIMITS)
    with pytest.raises(GoalRejected, match="more than limits.max_prompt_bytes=4096"):
        check_chat_bounds(goal(ChatMessage(role="user", content="x" * 3000),
                               ChatMessage(role="user", content="y" * 1200)), LIMITS)
    with pytest.raises(GoalRejected, match="exceed limits.max_grammar_bytes=2048"):
        check_chat_bounds(goal(ChatMessage(role="user", content="x"), tools=" " * 3000), LIMITS)


def test_empty_messages_are_not_free() -> None:
    """Each message and call counts its markup, and there are at most limits.max_prompt_tokens of
    them: 40,000 empty messages (0 bytes: they passed, then cost a minute to render and tokenize)
    are refused before anything parses them."""
    empty = ChatMessage(role="user", content="")
    check_chat_bounds(goal(*[empty] * 100), LIMITS)
    with pytest.raises(GoalRejected, match="counting 32 for each message and call"):
        check_chat_bounds(goal(*[empty] * 200), LIMITS)
    with pytest.raises(GoalRejected, match="40000 messages and calls, more than limits.max_prompt_tokens=1536"):
        check_chat_bounds(goal(*[empty] * 40000), dict(LIMITS, **{"limits.max_prompt_bytes": 1 << 26}))
    calls = [ToolCall(id=f"c{i}", name="go", arguments="") for i in range(2000)]
    with pytest.raises(GoalRejected, match="2001 messages and calls"):
        check_chat_bounds(goal(ChatMessage(role="assistant", tool_calls=calls)),
                          dict(LIMITS, **{"limits.max_prompt_bytes": 1 << 26}))


def test_a_reply_becomes_the_result() -> None:
    reply = AssistantReply("Going.", (Call("call_1", "move_to", '{"place": "dock"}'),),
                           "the reply calls 'fly', which is not a tool offered this turn")
    result = chat_result(reply, "Going. ", "stop", "", None, Time())
    assert (result.message.role, result.message.content, result.finish_reason) == ("assistant", "Going.", "tool_calls")
    assert [(c.id, c.name, c.arguments) for c in result.message.tool_calls] == [("call_1", "move_to", '{"place": "dock"}')]
    assert "'fly'" in result.error
    cut = chat_result(None, "half a sen", "timeout", "time_budget of 1 s ran out", None, Time())
    assert (cut.message.content, cut.finish_reason, cut.error) == ("half a sen", "timeout", "time_budget of 1 s ran out")
