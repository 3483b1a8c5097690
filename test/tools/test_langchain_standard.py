"""LangChain's standard chat-model tests (``langchain-tests``) for GemmaSpecChat, and its streaming,
structured output and usage against the served node.

Unit tests (no node): construction, standard parameters, ``bind_tools`` / ``with_structured_output``.
Integration tests: one node for the module serving the embedded Gemma 3 270M base model with the
agent suite's chat template as chat.template_path (the model has none), reached over ROS by the
model's default transport (GenerateChat goals, text streamed as feedback); a small ``max_tokens``
keeps them short.

The capability flags say what the node does. A standard test that the base model cannot pass is
marked xfail with its reason (and the exception it fails with: any other is a failure), here and
in docs/interfaces.md ("LangChain"); the only skips are
LangChain's own, for what the node does not have (images, audio, PDF, a per-call model, VCR
cassettes, environment-variable setup, serialisation).

langchain-tests brings pytest plugins (pytest-asyncio in strict mode, pytest-socket, pytest-benchmark,
syrupy, pytest-recording); the standard suite's async tests get pytest-asyncio's mark here (a class
mark: overriding them would fail the suite's test_no_overrides_DO_NOT_OVERRIDE).
"""
from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Type

import pytest

pytest.importorskip("langchain_core", reason="langchain-core (an optional extra) is not installed")
try:  # the standard suites, and pydantic (langchain-core's own dependency) for the schemas
    from langchain_tests.integration_tests import ChatModelIntegrationTests
    from langchain_tests.unit_tests import ChatModelUnitTests
    from pydantic import BaseModel
except ImportError:
    pytest.skip("langchain-tests is not installed (scripts/setup.sh installs it but in the Humble lane)",
                allow_module_level=True)

from langchain_core.exceptions import OutputParserException  # noqa: E402
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from gemma_spec_dev.langchain_chat import GemmaSpecChat, usage_metadata  # noqa: E402
from gemma_spec_ros.client import wait_until  # noqa: E402
from gemma_spec_ros.node.parameters import defaults  # noqa: E402
from support.chat import embedded_template_file  # noqa: E402
from support.node import ServedNode  # noqa: E402

NODE = "gemma_spec_langchain_std"
NODE_PATH = f"/{NODE}"
MAX_TOKENS = 48
TIMEOUT = 120.0
#: the node's target model as GemmaSpecChat names it (target.model_path's file name)
SERVED_MODEL = "gemma-3-270m-q4_k_m"

#: Why the embedded 270M base model fails a standard test (docs/interfaces.md lists them).
WRONG_ARGUMENT = ("model: the 270M base model calls magic_function with input 300, not 3 (the node holds the "
                  "call to the tool's schema, not to the question's number)")
NO_CALL_UNFORCED = ("model: with tool_choice auto the 270M base model answers in text and never opens a "
                    "tool call")
FREE_STRING = ("model: the 270M base model never closes the free customer_name string; max_tokens runs out "
               "inside the call (256 tokens too)")
JSON_MODE_KEYS = ("model: JSON mode holds the reply to a JSON object, and the 270M base model writes one "
                  "without the setup / punchline keys the prompt asks for")


@pytest.fixture(scope="module")
def langchain_node(node_client: Callable[..., ServedNode], tmp_path_factory: pytest.TempPathFactory,
                   embedded_model_path: Path) -> Iterator[ServedNode]:
    """The node of the module's integration tests; the ROS transports to it closed at the end."""
    folder = tmp_path_factory.mktemp("lc_std")
    overrides = {"target.model_path": str(embedded_model_path), "target.n_ctx": 2048, "spec.mode": "off",
                 "lookup.cache_dir": str(folder), "chat.template_path": str(embedded_template_file(folder))}
    served = node_client(NODE, {k: v for k, v in overrides.items() if v != defaults()[k]})
    yield served
    GemmaSpecChat(node=NODE_PATH, timeout=TIMEOUT).close()


@pytest.fixture
def idle(langchain_node: ServedNode) -> Iterator[ServedNode]:
    yield langchain_node
    wait_until(lambda: not langchain_node.node._goals.busy(), 60, "an idle queue after the test")


class Flags:
    """What the node does, as the standard suites' flags."""

    @property
    def chat_model_class(self) -> Type[GemmaSpecChat]:
        return GemmaSpecChat

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # auto | none | required ("any", True) | a tool's name

    @property
    def has_structured_output(self) -> bool:
        return True  # function_calling (default), json_schema, json_mode

    @property
    def supports_json_mode(self) -> bool:
        return True  # the goal's json_schema holds the text to a JSON object

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> Dict[str, List[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}  # stats.num_prompt_tokens_reused

    @property
    def supports_model_override(self) -> bool:
        return False  # the node serves one model

    @property
    def supports_image_inputs(self) -> bool:
        return False  # text only, as every message kind below

    supports_image_urls = supports_pdf_inputs = supports_audio_inputs = supports_video_inputs = \
        supports_image_tool_message = supports_pdf_tool_message = supports_anthropic_inputs = supports_image_inputs


class TestGemmaSpecChatUnit(Flags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> Dict[str, Any]:
        return {"node": NODE_PATH, "model": SERVED_MODEL}  # named: no node to ask in a unit test


class TestGemmaSpecChatIntegration(Flags, ChatModelIntegrationTests):
    pytestmark = [pytest.mark.usefixtures("langchain_node"), pytest.mark.asyncio, pytest.mark.filterwarnings(
        "ignore:The test <.*> is marked with '@pytest.mark.asyncio' but it is not an async function")]

    @property
    def chat_model_params(self) -> Dict[str, Any]:
        return {"node": NODE_PATH, "max_tokens": MAX_TOKENS, "timeout": TIMEOUT}  # the model: the node's

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A follow-up turn: the node keeps the conversation's KV, ``cache_read`` counts it."""
        model = GemmaSpecChat(**self.chat_model_params)
        history: List[BaseMessage] = [SystemMessage("You are a helpful assistant."), HumanMessage("Hello")]
        history += [model.invoke(history), HumanMessage("Say it again.")]
        reply = sum_chunks(model.stream(history)) if stream else model.invoke(history)
        assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
        return reply

    @pytest.mark.xfail(reason=WRONG_ARGUMENT, raises=AssertionError)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model: Any) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=WRONG_ARGUMENT, raises=AssertionError)
    async def test_tool_calling_async(self, model: Any) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason=NO_CALL_UNFORCED, raises=AssertionError)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=FREE_STRING, raises=AssertionError)
    def test_unicode_tool_call_integration(self, model: Any, *, tool_choice: Optional[str] = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @pytest.mark.xfail(reason=JSON_MODE_KEYS, raises=OutputParserException)
    def test_json_mode(self, model: Any) -> None:
        super().test_json_mode(model)


# ---- the acceptance, against the same node ------------------------------------------------

def sum_chunks(chunks: Iterator[AIMessageChunk]) -> AIMessageChunk:
    full: Optional[AIMessageChunk] = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    assert full is not None
    return full


class Recording:
    """The node's ROS transport, keeping each turn's result fields."""

    def __init__(self) -> None:
        from gemma_spec_dev.langchain_chat import ros_transport

        self.inner = ros_transport(NODE_PATH, TIMEOUT)
        self.results: List[Dict[str, Any]] = []
        self.pieces: List[str] = []

    def __call__(self, goal: Dict[str, Any]) -> Dict[str, Any]:
        self.results.append(self.inner(goal))
        return self.results[-1]

    def stream(self, goal: Dict[str, Any]) -> Iterator[Any]:
        for item in self.inner.stream(goal):
            if isinstance(item, Mapping):
                self.results.append(dict(item))
            else:
                self.pieces.append(item)
            yield item

    def model_name(self) -> str:
        return self.inner.model_name()


class Move(BaseModel):
    """Drive the robot to a place."""

    place: Literal["dock", "lab", "kitchen"]


@tool
def move_to(place: Literal["dock", "lab", "kitchen"]) -> str:
    """Drive the robot to a named place."""
    return f"arrived at {place}"


@pytest.mark.timeout(300)
def test_streaming_yields_chunks_that_add_up_to_the_message(idle: ServedNode) -> None:
    """Several chunks as the node streams (one per feedback text, then the last), whose sum is the
    result's message; the last carries chunk_position, usage and metadata, the others neither."""
    transport = Recording()
    model = GemmaSpecChat(node=NODE_PATH, transport=transport, max_tokens=MAX_TOKENS)
    chunks = list(model.stream("Write a short story about a robot."))
    result = transport.results[-1]
    assert len(transport.pieces) >= 3 and len(chunks) >= 3, (transport.pieces, chunks)
    full = sum_chunks(iter(chunks))
    assert full.content == result["message"]["content"] != ""
    assert "".join(c.content for c in chunks) == result["message"]["content"]
    assert chunks[-1].chunk_position == "last" and all(c.chunk_position is None for c in chunks[:-1])
    assert all(c.usage_metadata is None and not c.response_metadata.get("finish_reason") for c in chunks[:-1])
    assert full.response_metadata["finish_reason"] == result["finish_reason"]
    assert full.response_metadata["model_name"] == SERVED_MODEL


@pytest.mark.timeout(300)
def test_usage_metadata_matches_the_results_token_counts(idle: ServedNode) -> None:
    """invoke and stream: input = prompt_tokens, output = completion_tokens, total their sum,
    cache_read = stats.num_prompt_tokens_reused (a follow-up turn reuses its conversation)."""
    transport = Recording()
    model = GemmaSpecChat(node=NODE_PATH, transport=transport, max_tokens=16)
    history: List[BaseMessage] = [SystemMessage("You count."), HumanMessage("One, two,")]
    first = model.invoke(history)
    history += [first, HumanMessage("Go on.")]
    second = sum_chunks(model.stream(history))
    for message, result in ((first, transport.results[0]), (second, transport.results[1])):
        assert message.usage_metadata == {
            "input_tokens": result["prompt_tokens"], "output_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"],
            "input_token_details": {"cache_read": result["prompt_tokens_reused"]}} == usage_metadata(result)
        assert result["prompt_tokens"] > 0 and result["completion_tokens"] > 0
    assert transport.results[1]["prompt_tokens_reused"] > 0
    assert model._get_ls_params()["ls_model_name"] == SERVED_MODEL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_a_streamed_structured_output_chain_yields_the_parsed_object(idle: ServedNode, method: str) -> None:
    """``with_structured_output(...).stream()`` yields the parsed object (it yielded nothing before
    the model streamed): by a required call of the schema, or by text held to the schema."""
    chain = GemmaSpecChat(node=NODE_PATH, max_tokens=MAX_TOKENS).with_structured_output(Move, method=method)
    streamed = list(chain.stream("Go to the dock."))
    assert streamed and all(isinstance(item, Move) for item in streamed), streamed
    assert streamed[-1] == chain.invoke("Go to the dock.")
    as_dict = GemmaSpecChat(node=NODE_PATH, max_tokens=MAX_TOKENS).with_structured_output(
        Move.model_json_schema(), method=method)
    assert list(as_dict.stream("Go to the dock."))[-1]["place"] in ("dock", "lab", "kitchen")


@pytest.mark.timeout(300)
def test_a_streamed_turn_has_the_calls_of_its_result(idle: ServedNode) -> None:
    """The calls come in the last chunk as tool-call chunks: the summed message's tool_calls are the
    result's calls, as invoke's are."""
    transport = Recording()
    agent = GemmaSpecChat(node=NODE_PATH, transport=transport, max_tokens=MAX_TOKENS).bind_tools(
        [move_to], tool_choice="any")
    full = sum_chunks(agent.stream("Go to the lab."))
    calls = transport.results[-1]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["name"] == "move_to"
    assert full.tool_calls == [{"name": "move_to", "args": json.loads(calls[0]["arguments"]), "id": calls[0]["id"],
                                "type": "tool_call"}]
    assert full.content == transport.results[-1]["message"]["content"]
    assert full.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.timeout(300)
def test_leaving_a_stream_early_cancels_the_turn(idle: ServedNode) -> None:
    model = GemmaSpecChat(node=NODE_PATH, max_tokens=400)
    chunks = model.stream("Write a long story about a robot.")
    assert next(chunks).content
    started = idle.node._goals.busy()
    chunks.close()
    wait_until(lambda: not idle.node._goals.busy(), 30, "the cancelled turn to end")
    assert started
    assert model.invoke("Hello", max_tokens=4).content  # the node serves on


@pytest.mark.timeout(120)
def test_close_then_use_opens_a_new_client(idle: ServedNode) -> None:
    from gemma_spec_ros.client import chat_transport

    model = GemmaSpecChat(node=NODE_PATH, max_tokens=4, timeout=TIMEOUT)
    assert model.invoke("Hello").content
    model.close()
    transport = chat_transport(NODE_PATH, TIMEOUT)
    assert transport.closed
    assert model.invoke("Hello").content and not transport.closed


def test_a_script_that_never_closes_its_transport_exits_cleanly(venv_python: Path, tmp_path: Path) -> None:
    """The transports close themselves at exit: a script that made one and returned used to abort
    ("terminate called without an active exception", about one run in two; measured 9 of 20) while
    its client's executor thread still spun into the interpreter's teardown."""
    script = tmp_path / "no_close.py"
    script.write_text(textwrap.dedent("""
        from gemma_spec_ros.client import chat_transport
        chat_transport("/gemma_spec_absent", 5.0)
        print("done")
    """))
    for _ in range(5):
        done = subprocess.run([str(venv_python), str(script)], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, "done"), done.stderr[-2000:]
