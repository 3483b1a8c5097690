"""A LangChain chat model over the node's GenerateChat action, so that LangChain / LangGraph agents
(ROSA-style planners) can plan with the robot's own model, tools and all.

    from gemma_spec_dev.langchain_chat import GemmaSpecChat
    model = GemmaSpecChat(node="/gemma_spec").bind_tools([move_to, pick, say])
    reply = model.invoke([SystemMessage("You plan for a robot."), HumanMessage("Bring the cup.")])
    reply.tool_calls                     # [{"name": "move_to", "args": {...}, "id": ...}], validated

An optional extra: ``pip install langchain-core`` (1.x); nothing else in the project imports this
module. The node renders the conversation with the model's own template, constrains the reply to
calls of the bound tools (``tool_choice``: LangChain's ``"any"`` / ``True`` read as required) and
validates each call's arguments against its tool's schema before it comes back; a call that does
not validate is in ``reply.invalid_tool_calls`` with the node's reason. Each turn sends the whole
conversation; the node evaluates only what is new since the conversation's last turn.

The wire is one function, ``transport(goal fields) -> result fields`` (plain dicts in the shape of
GenerateChat's goal and result): by default a ROS client of the node
(:func:`ros_transport`); tests and other rigs pass their own.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool

#: goal fields -> result fields (GenerateChat's, as plain dicts)
Transport = Callable[[Dict[str, Any]], Dict[str, Any]]
#: LangChain's message types -> the action's roles
ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}


def text_of(content: Union[str, Sequence[Any]]) -> str:
    """A message's text: a string, or the text blocks of a list of content blocks."""
    if isinstance(content, str):
        return content
    return "".join(block if isinstance(block, str) else str(block.get("text", ""))
                   for block in content if isinstance(block, (str, dict)))


def chat_message(message: BaseMessage) -> Dict[str, Any]:
    """One LangChain message as a ChatMessage's fields."""
    role = ROLES.get(message.type)
    if role is None:
        raise ValueError(f"a {message.type!r} message has no GenerateChat role (system, human, ai, tool)")
    entry: Dict[str, Any] = {"role": role, "content": text_of(message.content), "name": message.name or "",
                             "tool_call_id": "", "tool_calls": []}
    if isinstance(message, ToolMessage):
        entry["tool_call_id"] = message.tool_call_id
    if isinstance(message, AIMessage):
        entry["tool_calls"] = [{"id": call.get("id") or f"call_{i}", "name": call["name"],
                                "arguments": json.dumps(call.get("args") or {})}
                               for i, call in enumerate(message.tool_calls)]
    return entry


def tool_choice_of(choice: Any) -> str:
    """LangChain's ``tool_choice`` spellings as the action's: ``"any"`` / True -> required, a tool
    dict -> its name, None -> auto.

    >>> [tool_choice_of(c) for c in (None, "any", True, "auto", "move_to", {"function": {"name": "say"}})]
    ['auto', 'required', 'required', 'auto', 'move_to', 'say']
    """
    if choice is None or choice is False:
        return "auto"
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, dict):
        return str((choice.get("function") or choice).get("name", "auto"))
    return str(choice)


def goal_fields(messages: Sequence[BaseMessage], tools: Sequence[Mapping[str, Any]] = (),
                tool_choice: Any = None, parallel_tool_calls: bool = False,
                stop: Optional[Sequence[str]] = None, **settings: Any) -> Dict[str, Any]:
    """A GenerateChat goal's fields for ``messages``: the conversation, the tools (OpenAI's shape),
    and the sampling / budget settings (``max_tokens``, ``temperature``, ``spec_mode``...)."""
    goal: Dict[str, Any] = {"messages": [chat_message(m) for m in messages],
                            "tools": json.dumps(list(tools)) if tools else "",
                            "tool_choice": tool_choice_of(tool_choice) if tools else "",
                            "parallel_tool_calls": bool(parallel_tool_calls), "stop": list(stop or ())}
    goal.update(settings)
    return goal


def ai_message(result: Mapping[str, Any]) -> AIMessage:
    """A GenerateChat result's fields as an AIMessage: its text, its calls as LangChain tool calls,
    and the node's reason for anything left out as an invalid tool call."""
    message = result["message"]
    calls = [tool_call(name=c["name"], args=json.loads(c["arguments"] or "{}"), id=c["id"])
             for c in message.get("tool_calls", [])]
    invalid = [invalid_tool_call(error=result["error"])] if result.get("error") and \
        result.get("finish_reason") in ("stop", "tool_calls", "length") else []
    metadata = {key: result.get(key) for key in ("finish_reason", "spec_mode", "prompt_tokens",
                                                 "prompt_tokens_reused", "completion_tokens", "error")}
    return AIMessage(content=message.get("content", ""), tool_calls=calls, invalid_tool_calls=invalid,
                     response_metadata=metadata)


def ros_transport(node: str, timeout: float = 300.0) -> Transport:
    """A transport over ROS: a client of the node at ``node`` (rclpy initialised on first use)."""
    from gemma_spec_ros.client import chat_transport  # noqa: WPS433  imported lazily: it needs rclpy

    return chat_transport(node, timeout)


class GemmaSpecChat(BaseChatModel):
    """A chat model served by a gemma_spec node (see the module docstring)."""

    node: str = "/gemma_spec"
    max_tokens: int = 0  # 0 = the node's generation.max_tokens
    temperature: float = 0.0
    spec_mode: str = ""  # '' = the node's spec.mode
    timeout: float = 300.0  # seconds a turn may take, waiting in the queue included
    transport: Optional[Transport] = None  # None: ros_transport(node)

    @property
    def _llm_type(self) -> str:
        return "gemma-spec-ros"

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   parallel_tool_calls: bool = False, **kwargs: Any) -> Any:
        """The model with ``tools`` (LangChain tools, functions, pydantic models or OpenAI dicts)."""
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice,
                         parallel_tool_calls=parallel_tool_calls, **kwargs)

    def _generate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        goal = goal_fields(messages, kwargs.pop("tools", ()), kwargs.pop("tool_choice", None),
                           kwargs.pop("parallel_tool_calls", False), stop, max_tokens=self.max_tokens,
                           temperature=self.temperature, spec_mode=self.spec_mode, **kwargs)
        transport = self.transport or ros_transport(self.node, self.timeout)
        result = transport(goal)
        if result.get("finish_reason") in ("error", "cancelled", "preempted", "timeout") and \
                not result["message"].get("content") and not result["message"].get("tool_calls"):
            raise RuntimeError(f"the node ended the turn with {result['finish_reason']}: {result.get('error')}")
        message = ai_message(result)
        generation = ChatGeneration(message=message, generation_info=dict(message.response_metadata))
        return ChatResult(generations=[generation])


__all__ = ["GemmaSpecChat", "Transport", "ai_message", "chat_message", "goal_fields", "ros_transport",
           "tool_choice_of"]
