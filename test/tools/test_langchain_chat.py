"""The LangChain chat model (gemma_spec_dev.langchain_chat): LangChain messages and tools ->
GenerateChat goal fields -> a served turn -> result fields -> AIMessage with tool calls, in a
tool-calling loop, twice: against the real node over ROS (its default transport: a GenerateChat
client, rclpy over loopback, the engine's loop), and with the chat layer run in-process as the
transport. Model: the tiny random-weight GGUF with a Gemma 4 style template (native calls).

langchain-core is an optional extra of the package; scripts/setup.sh installs it, so this runs in
CI (it skips, saying so, only in a venv made without it)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Literal

import pytest

langchain_core = pytest.importorskip("langchain_core", reason="langchain-core (an optional extra) is not installed")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from gemma_spec_dev.langchain_chat import GemmaSpecChat, chat_message, goal_fields  # noqa: E402
from gemma_spec_ros.engine.chat import conversation_from_json, prepare_turn  # noqa: E402
from gemma_spec_ros.node.parameters import defaults  # noqa: E402
from support.chat import ChatModel  # noqa: E402
from support.tiny_chat_gguf import write_tiny_chat_gguf  # noqa: E402

NODE = "gemma_spec_langchain"


# Literal arguments: a random-weight model writing a free string would not stop within the budget.
@tool
def move_to(place: Literal["dock", "lab"]) -> str:
    """Drive the robot to a named place."""
    return f"arrived at {place}"


@tool
def say(text: Literal["hi", "bye"]) -> str:
    """Speak a sentence."""
    return "said"


class InProcessTurns:
    """A transport that serves each goal with the chat layer on a tiny Gemma 4 style model."""

    def __init__(self, path: Path) -> None:
        self.model = ChatModel(path)
        self.goals: list = []

    def __call__(self, goal: Dict[str, Any]) -> Dict[str, Any]:
        self.goals.append(goal)
        conversation = conversation_from_json({
            "messages": goal["messages"], "tools": json.loads(goal["tools"] or "[]"),
            "tool_choice": goal["tool_choice"], "parallel_tool_calls": goal["parallel_tool_calls"]})
        turn = prepare_turn(conversation, self.model.template, self.model.vocab)
        decoded = self.model.decode(turn, max_tokens=120)
        reply = decoded.reply(conversation)
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
        return {"message": {"role": "assistant", "content": reply.content, "tool_calls": calls},
                "finish_reason": reply.finish_reason(decoded.ended), "error": reply.error,
                "spec_mode": "off", "prompt_tokens": len(turn.tokens), "completion_tokens": len(decoded.tokens)}


@pytest.fixture(scope="module")
def turns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessTurns]:
    transport = InProcessTurns(write_tiny_chat_gguf(tmp_path_factory.mktemp("lc") / "chat.gguf"))
    yield transport
    transport.model.close()


def test_module_doctests() -> None:
    import doctest

    from gemma_spec_dev import langchain_chat

    assert doctest.testmod(langchain_chat).failed == 0


def test_langchain_messages_become_goal_fields() -> None:
    call = {"name": "move_to", "args": {"place": "dock"}, "id": "c1"}
    messages = [SystemMessage("plan"), HumanMessage([{"type": "text", "text": "go"}]),
                AIMessage("", tool_calls=[call]), ToolMessage("arrived", tool_call_id="c1")]
    goal = goal_fields(messages, [{"type": "function", "function": {"name": "move_to"}}], "any", True,
                       ["END"], max_tokens=32)
    assert [m["role"] for m in goal["messages"]] == ["system", "user", "assistant", "tool"]
    assert goal["messages"][1]["content"] == "go"
    assert goal["messages"][2]["tool_calls"] == [{"id": "c1", "name": "move_to", "arguments": '{"place": "dock"}'}]
    assert goal["messages"][3]["tool_call_id"] == "c1"
    assert (goal["tool_choice"], goal["parallel_tool_calls"], goal["stop"], goal["max_tokens"]) == \
        ("required", True, ["END"], 32)
    assert chat_message(HumanMessage("hi", name="op"))["name"] == "op"


def tool_calling_loop(model: GemmaSpecChat) -> list:
    """bind_tools with LangChain tools, three turns: each reply's calls are LangChain tool calls of
    the bound tools with their arguments; their results go back as ToolMessages; the last turn
    (tool_choice none) answers in text. The conversation, for the caller's checks."""
    tools = {"move_to": move_to, "say": say}
    agent = model.bind_tools(list(tools.values()), tool_choice="any")
    history = [SystemMessage("You plan for a robot."), HumanMessage("Go to the dock, then say hi.")]
    for _ in range(2):
        reply = agent.invoke(history)
        assert isinstance(reply, AIMessage) and reply.tool_calls and not reply.invalid_tool_calls
        history.append(reply)
        for call in reply.tool_calls:
            assert call["name"] in tools and set(call["args"]) <= {"place", "text"}
            history.append(ToolMessage(str(tools[call["name"]].invoke(call["args"])), tool_call_id=call["id"]))
        assert reply.response_metadata["finish_reason"] == "tool_calls"
    final = model.bind_tools(list(tools.values()), tool_choice="none").invoke(history)
    assert final.tool_calls == [] and final.response_metadata["finish_reason"] in ("stop", "length")
    return history + [final]


def test_a_tool_calling_loop_in_process(turns: InProcessTurns) -> None:
    tool_calling_loop(GemmaSpecChat(transport=turns, max_tokens=120))
    sent = turns.goals[-1]["messages"]
    assert [m["role"] for m in sent][:4] == ["system", "user", "assistant", "tool"]


@pytest.fixture(scope="module")
def node_path(node_client: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A node serving the tiny Gemma 4 style model, active; the LangChain model's own ROS transport
    to it is closed at the end."""
    from gemma_spec_ros.client import chat_transport

    folder = tmp_path_factory.mktemp("lc_node")
    overrides = {"target.model_path": str(write_tiny_chat_gguf(folder / "chat.gguf")), "target.n_ctx": 2048,
                 "target.n_threads": 1, "lookup.cache_dir": str(folder), "spec.mode": "suffix"}
    node_client(NODE, {k: v for k, v in overrides.items() if v != defaults()[k]})
    yield f"/{NODE}"
    chat_transport(f"/{NODE}", 120.0).close()
    chat_transport.cache_clear()


@pytest.mark.timeout(300)
def test_a_tool_calling_loop_against_the_served_node(node_path: str) -> None:
    """The same loop against the node: GemmaSpecChat(node=...) with no transport of its own sends
    each turn as a GenerateChat goal; the later turns reuse the conversation's KV on the node."""
    history = tool_calling_loop(GemmaSpecChat(node=node_path, max_tokens=120, timeout=120.0))
    replies = [m for m in history if isinstance(m, AIMessage)]
    assert len(replies) == 3 and all(m.response_metadata["spec_mode"].startswith("suffix") for m in replies)
    assert replies[-1].response_metadata["prompt_tokens_reused"] > 0
