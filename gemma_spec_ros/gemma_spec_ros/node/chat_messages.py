"""The GenerateChat action's messages <-> the chat layer's types: pure mapping, no rclpy node.

In: a goal -> a chat request (:func:`chat_request_from_goal`: the size checks of
:func:`check_chat_bounds`, the messages and tools -> a
:class:`~gemma_spec_ros.engine.chat.Conversation` by :func:`conversation_from_goal`, whose
refusals name the message they are about, and the sampling fields as Generate's). Out: an
:class:`~gemma_spec_ros.engine.chat.AssistantReply` and the last step -> the result
(:func:`chat_result`), a step -> feedback (:func:`chat_feedback`).

A chat goal's ``grammar`` / ``json_schema`` are its own: the node's ``generation.grammar`` /
``generation.json_schema`` defaults constrain Generate goals only (a tool call has its own grammar).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from builtin_interfaces.msg import Time
from gemma_spec_msgs.action import GenerateChat
from gemma_spec_msgs.msg import ChatMessage as ChatMessageMsg
from gemma_spec_msgs.msg import ToolCall as ToolCallMsg

from ..engine.chat import AssistantReply, ChatMessage, Conversation, ToolCall, parse_tools
from ..engine.request import GenerationRequest, Step
from .messages import GoalRejected, check_stop_and_grammar_bounds, request_with, result


def chat_request_from_goal(goal: Any, values: Mapping[str, Any]) -> GenerationRequest:
    """A GenerateChat goal + the node's parameter values -> a chat request, or GoalRejected with
    the reason (sizes first, before anything is parsed)."""
    check_chat_bounds(goal, values)
    check_stop_and_grammar_bounds(goal, values)
    return request_with(goal, values, conversation=conversation_from_goal(goal), grammar=goal.grammar,
                        json_schema=goal.json_schema)


#: Bytes a message or a call counts on top of its strings: the template's markup around it (a
#: turn's markers, a call's name and braces). An empty message is not free to render and tokenize.
ITEM_OVERHEAD_BYTES = 32


def check_chat_bounds(goal: Any, values: Mapping[str, Any]) -> None:
    """GoalRejected if the conversation's text (every message's strings and the tools, each
    message and call counting :data:`ITEM_OVERHEAD_BYTES` more) exceeds ``limits.max_prompt_bytes``,
    if it has more messages and calls than ``limits.max_prompt_tokens`` (each renders to one token
    at least), or if a tools text exceeds ``limits.max_grammar_bytes`` (the tools become a grammar);
    cheap, before anything parses or tokenizes it."""
    items = len(goal.messages) + sum(len(m.tool_calls) for m in goal.messages)
    if items > values["limits.max_prompt_tokens"]:
        raise GoalRejected(f"the conversation has {items} messages and calls, more than "
                           f"limits.max_prompt_tokens={values['limits.max_prompt_tokens']} (each "
                           "takes one prompt token at least)")
    size = sum(len(s.encode("utf-8", "replace")) for m in goal.messages
               for s in (m.content, m.name, m.tool_call_id, *(c.arguments for c in m.tool_calls)))
    size += len(goal.tools.encode("utf-8", "replace")) + items * ITEM_OVERHEAD_BYTES
    if size > values["limits.max_prompt_bytes"]:
        raise GoalRejected(f"the conversation's messages and tools take {size} bytes (counting "
                           f"{ITEM_OVERHEAD_BYTES} for each message and call), more than "
                           f"limits.max_prompt_bytes={values['limits.max_prompt_bytes']}")
    tools = len(goal.tools.encode("utf-8", "replace"))
    if tools > values["limits.max_grammar_bytes"]:
        raise GoalRejected(f"tools of {tools} bytes exceed limits.max_grammar_bytes="
                           f"{values['limits.max_grammar_bytes']} (the tools become the reply's grammar)")


def conversation_from_goal(goal: Any) -> Conversation:
    """A GenerateChat goal's conversation, checked (see engine/chat/conversation.py); GoalRejected
    with the reason, naming the message.

    >>> from types import SimpleNamespace as M
    >>> goal = M(messages=[M(role="user", content="hi", name="", tool_call_id="", tool_calls=[])],
    ...          tools="", tool_choice="", parallel_tool_calls=False)
    >>> conversation_from_goal(goal).messages[0].content
    'hi'
    >>> goal.messages[0].role = "robot"
    >>> conversation_from_goal(goal)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gemma_spec_ros.node.messages.GoalRejected: messages[0]: unknown role 'robot': expected one of ...
    """
    messages = []
    for i, message in enumerate(goal.messages):
        try:
            calls = tuple(ToolCall(c.id or f"call_{i}_{j}", c.name, c.arguments or "{}")
                          for j, c in enumerate(message.tool_calls))
            messages.append(ChatMessage(message.role, message.content, message.name, message.tool_call_id, calls))
        except ValueError as exc:
            raise GoalRejected(f"messages[{i}]: {exc}") from None
    try:
        return Conversation(tuple(messages), parse_tools(goal.tools), goal.tool_choice or "auto",
                            bool(goal.parallel_tool_calls))
    except ValueError as exc:
        raise GoalRejected(str(exc)) from None


def message_msg(reply: AssistantReply) -> ChatMessageMsg:
    """The assistant's message of a reply."""
    return ChatMessageMsg(role="assistant", content=reply.content, tool_calls=[
        ToolCallMsg(id=c.id, name=c.name, arguments=c.arguments) for c in reply.tool_calls])


def chat_feedback(step: Step, text: str) -> GenerateChat.Feedback:
    """Feedback for one engine step with the message's text streamed since the last feedback."""
    return GenerateChat.Feedback(
        text=text, completion_tokens=step.stats.num_generated_tokens,
        mean_acceptance_length=step.stats.mean_acceptance_length,
        tokens_per_second=step.stats.tokens_per_second, spec_mode=step.spec_mode, draft_max=step.draft_max)


def chat_result_of(text: str, finish_reason: str, error: str, last: Optional[Step], stamp: Time) -> GenerateChat.Result:
    """The result of a turn that ended at ``last`` (its reply, if the engine read one)."""
    return chat_result(last.reply if last is not None else None, text, finish_reason, error, last, stamp)


def chat_result(reply: Optional[AssistantReply], text: str, finish_reason: str, error: str,
                last: Optional[Step], stamp: Time) -> GenerateChat.Result:
    """The goal's result: the assistant's message (the reply, or the streamed ``text`` when the turn
    ended before a reply was read), ``tool_calls`` as the finish reason of a turn that stopped with
    calls, the reply's reason for a call left out in ``error``, and the counts and stats of
    :func:`~gemma_spec_ros.node.messages.result`."""
    reply = reply if reply is not None else AssistantReply(text.strip())
    errors = "; ".join(e for e in (error, reply.error) if e)
    plain = result("", reply.finish_reason(finish_reason), errors, last, stamp)
    return GenerateChat.Result(message=message_msg(reply), finish_reason=plain.finish_reason,
                               prompt_tokens=plain.prompt_tokens, completion_tokens=plain.completion_tokens,
                               spec_mode=plain.spec_mode, stats=plain.stats, error=plain.error)


__all__ = ["ITEM_OVERHEAD_BYTES", "chat_feedback", "chat_request_from_goal", "chat_result", "chat_result_of",
           "check_chat_bounds",
           "conversation_from_goal", "message_msg"]
