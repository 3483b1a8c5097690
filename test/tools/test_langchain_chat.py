"""The LangChain chat model (gemma_spec_dev.langchain_chat): LangChain messages and tools ->
GenerateChat goal fields -> a served turn -> result fields -> AIMessage with tool calls, in a
tool-calling loop, twice: against the real node over ROS (its default transport: a GenerateChat
client, rclpy over loopback, the engine's loop), and with the chat layer run in-process as the
transport. Model: the tiny random-weight GGUF with a Gemma 4 style template (native calls). And
streaming, usage and structured output over scripted transports (no model): the chunks, what the
last one carries, how they add up. LangChain's standard suites, and streaming against the served
embedded model, are in test_langchain_standard.py.

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

try:
    from pydantic import BaseModel  # langchain-core's own dependency: there whenever it is
except ImportError:
    pytest.skip("pydantic (langchain-core's dependency) is not installed", allow_module_level=True)

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


class ScriptedTurns:
    """A transport that streams scripted text pieces, then a scripted result (no model, no ROS)."""

    def __init__(self, pieces: list, content: str, calls: list = (), **result: Any) -> None:
        self.pieces, self.goals = list(pieces), []
        self.result = {"message": {"role": "assistant", "content": content, "tool_calls": list(calls)},
                       "finish_reason": "tool_calls" if calls else "stop", "error": "", "spec_mode": "off",
                       "prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_reused": 30, **result}
        self.closed = 0

    def __call__(self, goal: Dict[str, Any]) -> Dict[str, Any]:
        self.goals.append(goal)
        return self.result

    def stream(self, goal: Dict[str, Any]) -> Iterator[Any]:
        self.goals.append(goal)
        yield from self.pieces
        yield self.result

    def model_name(self) -> str:
        return "scripted-model"

    def close(self) -> None:
        self.closed += 1


def summed(chunks: Iterator[Any]) -> Any:
    full = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    return full


def test_a_stream_is_the_node_text_piece_by_piece_then_a_last_chunk_with_usage() -> None:
    """Each feedback text is a chunk (the message's surrounding whitespace left out, as the node's
    message has it stripped); the last chunk has the rest, the usage and the metadata, once."""
    turns = ScriptedTurns(["\n", "Hello", " ", "robot", "\n"], "Hello robot.")
    model = GemmaSpecChat(transport=turns, max_tokens=16)
    chunks = list(model.stream("hi"))
    assert [c.content for c in chunks] == ["Hello", " robot", "."]
    assert [c.chunk_position for c in chunks] == [None, None, "last"]
    full = summed(iter(chunks))
    assert full.content == model.invoke("hi").content == "Hello robot."
    assert full.usage_metadata == model.invoke("hi").usage_metadata == {
        "input_tokens": 40, "output_tokens": 9, "total_tokens": 49, "input_token_details": {"cache_read": 30}}
    assert (full.response_metadata["model_name"], full.response_metadata["finish_reason"]) == ("scripted-model", "stop")
    assert model._get_ls_params(stop=["x"])["ls_model_name"] == "scripted-model"
    assert model._get_ls_params(model="other")["ls_model_name"] == "other"
    with pytest.raises(ValueError, match="cannot pick another model"):
        model.invoke("hi", model="other")
    assert turns.goals[0]["max_tokens"] == 16 and "model" not in turns.goals[-1]
    model.close()
    assert turns.closed == 1


def test_a_streamed_calls_message_parses_as_tool_calls_and_structured_output() -> None:
    calls = [{"id": "c1", "name": "Place", "arguments": '{"place": "dock"}'}]
    turns = ScriptedTurns([], "", calls)

    class Place(BaseModel):
        """Where to go."""

        place: Literal["dock", "lab"]

    full = summed(GemmaSpecChat(transport=turns).bind_tools([Place], tool_choice="any").stream("go"))
    assert full.tool_calls == [{"name": "Place", "args": {"place": "dock"}, "id": "c1", "type": "tool_call"}]
    assert list(GemmaSpecChat(transport=turns).with_structured_output(Place).stream("go")) == [Place(place="dock")]
    assert turns.goals[-1]["tool_choice"] == "required"

    as_text = ScriptedTurns(['{"place": ', '"lab"}'], '{"place": "lab"}')
    chain = GemmaSpecChat(transport=as_text).with_structured_output(Place, method="json_schema")
    assert list(chain.stream("go"))[-1] == Place(place="lab") == chain.invoke("go")
    assert json.loads(as_text.goals[-1]["json_schema"])["properties"]["place"]["enum"] == ["dock", "lab"]
    GemmaSpecChat(transport=as_text).with_structured_output(None, method="json_mode").invoke("go")
    assert json.loads(as_text.goals[-1]["json_schema"]) == {"type": "object"}


def test_a_transport_without_stream_streams_one_turn_as_one_chunk(turns: InProcessTurns) -> None:
    """The in-process chat layer has no stream: the whole message comes in the last chunk, calls
    and all, and equals invoke's."""
    agent = GemmaSpecChat(transport=turns, max_tokens=120).bind_tools([move_to, say], tool_choice="any")
    history = [SystemMessage("You plan for a robot."), HumanMessage("Go to the dock, then say hi.")]
    chunks = list(agent.stream(history))
    invoked = agent.invoke(history)
    assert len(chunks) == 1 and chunks[0].chunk_position == "last"

    def without_ids(calls: list) -> list:  # each turn's calls get new ids
        return [{k: v for k, v in call.items() if k != "id"} for call in calls]

    assert without_ids(chunks[0].tool_calls) == without_ids(invoked.tool_calls) != []
    assert chunks[0].usage_metadata == invoked.usage_metadata
