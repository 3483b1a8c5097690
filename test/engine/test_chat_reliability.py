"""Chat turns that must end alone, with a reason, and never take the engine or its scheduler down.

Real llama.cpp on a tiny Gemma 4 style chat GGUF (test/support/tiny_chat_gguf.py). Each test names
the defect it guards and fails on the code before its fix:

- a tool schema whose ``$ref`` points outside its parameters compiled in the reply's grammar (the
  call schema wraps the parameters) but not in jsonschema's validation, which raised at the turn's
  end; with several requests at once a cancel between two rounds let that exception end the
  scheduler's thread and free the models while the node stayed active;
- ``chat.template_path`` was read with a plain ``open().read()`` (a FIFO hung configure, /dev/zero
  exhausted memory, any text file became the prompt), and a template's loops ran unbounded;
- a reference into the parameters themselves (``#/properties/...``, ``#``) pointed into the call
  wrapper in the JSON grammar, and Gemma 4's grammar ignored it: the grammar and the validation
  read two different schemas.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import List

import pytest

from gemma_spec_ros.engine.chat import ChatMessage, Conversation, Tool, parse_tools
from gemma_spec_ros.engine.chat.reply import ReplyStream, validated
from gemma_spec_ros.engine.chat.syntax import Parsed
from gemma_spec_ros.engine.chat.template import ChatTemplate, TemplateError
from gemma_spec_ros.engine.chat.turn import MAX_TEMPLATE_BYTES, template_file
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import EngineError
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.request import GenerationRequest
from support.tiny_chat_gguf import GEMMA3_STYLE, write_tiny_chat_gguf

OUTSIDE_REF = {"type": "object", "properties": {"x": {"$ref": "#/properties/name"}, "note": {"type": "string"}},
               "required": ["x", "note"]}
#: A tree of nodes: each node's children are nodes again (a reference to the parameters' root).
TREE = {"type": "object", "properties": {"label": {"enum": ["a", "b"]},
                                         "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
        "required": ["label", "children"]}


#: Two values of one enum, the second by reference to the first's schema.
PAIR = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}, "other": {"$ref": "#/properties/label"}},
        "required": ["label", "other"]}


def tools_json(name: str, parameters: dict) -> str:
    return json.dumps([{"type": "function", "function": {"name": name, "parameters": parameters}}])


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Gemma 4's native call syntax, and Gemma 3's turns (the fallback: JSON calls in tags)."""
    folder = tmp_path_factory.mktemp("chat-reliability")
    return {"gemma4": write_tiny_chat_gguf(folder / "gemma4-style.gguf"),
            "gemma3": write_tiny_chat_gguf(folder / "gemma3-style.gguf", template=GEMMA3_STYLE, seed=1)}


@pytest.fixture(scope="module")
def model(chat_models: dict) -> Path:
    return chat_models["gemma4"]


def engine_of(model: Path, max_running: int = 1) -> Engine:
    return Engine(EngineConfig(target=ModelConfig(str(model), n_ctx=2048, n_batch=256, n_threads=1),
                               spec=SpecConfig(mode="off", draft_max=4),
                               chat=ChatConfig(conversation_cache_bytes=8 << 20), max_running=max_running),
                  calibrate=False)


def turn(tools: str, choice: str = "required", max_tokens: int = 120) -> GenerationRequest:
    conversation = Conversation((ChatMessage("user", "plan it."),), parse_tools(tools), choice, False)
    return GenerationRequest(conversation=conversation, max_tokens=max_tokens, sampling=SamplingParams())


def test_a_reference_outside_the_parameters_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="points to nothing in the parameters themselves"):
        parse_tools(tools_json("go", OUTSIDE_REF))
    for ref in ("other.json#/a", "#anchor", "https://example.invalid/s.json"):
        with pytest.raises(ValueError, match="not a reference within the parameters"):
            parse_tools(tools_json("go", {"type": "object", "properties": {"x": {"$ref": ref}}}))


def nested_object(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_tool_schema_nested_too_deep_is_refused_with_the_reason() -> None:
    """100 objects deep (201 levels) ran jsonschema's meta-schema check out of Python's stack: the
    goal was refused with a RecursionError's words. The nesting is bounded before the check."""
    with pytest.raises(ValueError, match="tool 'go': objects and arrays nested deeper than 64 levels"):
        parse_tools(tools_json("go", nested_object(100)))
    assert parse_tools(tools_json("go", nested_object(31)))[0].name == "go"  # 63 levels


@pytest.mark.parametrize("style", ["gemma4", "gemma3"])
def test_references_into_the_parameters_hold_in_the_reply(chat_models: dict, style: str) -> None:
    """``#/properties/label`` is the parameters' label in the reply's grammar too (it pointed into
    the call wrapper: the JSON grammar then referred to nothing, Gemma 4's ignored it), in Gemma
    4's native syntax and in JSON calls; a recursive schema (``#``) compiles in both."""
    with engine_of(chat_models[style]) as served:
        reply = list(served.generate(turn(tools_json("pair", PAIR))))[-1].reply
        assert reply is not None and reply.error == "" and len(reply.tool_calls) == 1, reply
        arguments = json.loads(reply.tool_calls[0].arguments)
        assert arguments["label"] in ("a", "b") and arguments["other"] in ("a", "b")
        assert served.count_prompt(turn(tools_json("tree", TREE))).constraint is not None


def test_a_schema_validation_cannot_apply_leaves_the_call_out_with_the_reason() -> None:
    """A tool made without the goal check (its schema refers outside itself): the call is left out,
    the reply says why, nothing raises (before: jsonschema's _WrappedReferencingError)."""
    conversation = Conversation((ChatMessage("user", "go"),), (Tool("go", "", OUTSIDE_REF),), "required", False)
    calls, errors = validated(conversation, Parsed("", (("go", {"x": "go", "note": "n"}),), ""))
    assert calls == () and len(errors) == 1 and "could not be checked against its schema" in errors[0]


@pytest.mark.timeout(600)
def test_a_turn_whose_last_step_fails_between_rounds_ends_alone(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three at once, 200 turns cancelled at random points while two plain requests run beside
    them: a turn whose last step cannot be made (its reply raises: a fake, since no real input can
    make the reply raise any more) ends with its error; the scheduler runs on, the models stay,
    every plain request ends normally."""
    real_reply = ReplyStream.reply

    def failing_reply(self: ReplyStream, conversation: Conversation, finish: str):  # type: ignore[no-untyped-def]
        if finish == "cancelled":
            raise RuntimeError("the reply could not be read")
        return real_reply(self, conversation, finish)

    monkeypatch.setattr(ReplyStream, "reply", failing_reply)
    tools = tools_json("tree", TREE)
    with engine_of(model, max_running=3) as served:
        errors: List[BaseException] = []
        ends: List[str] = []

        def plain() -> None:
            request = GenerationRequest(prompt="the robot", max_tokens=40, sampling=SamplingParams(), spec_mode="off")
            ends.append(list(served.generate(request))[-1].finish_reason or "")

        for attempt in range(200):
            runners = [threading.Thread(target=plain) for _ in range(2)]
            for runner in runners:
                runner.start()
            cancel = threading.Event()
            try:
                for n, _ in enumerate(served.generate(turn(tools, max_tokens=60), cancel)):
                    if n >= attempt % 7:
                        cancel.set()
            except EngineError:
                raise
            except RuntimeError as exc:
                errors.append(exc)
            for runner in runners:
                runner.join(timeout=120)
            assert served.status()["scheduler"] == "running", f"the scheduler stopped at attempt {attempt}"
        assert len(ends) == 400 and set(ends) <= {"length", "stop"}
        assert errors, "no turn was cancelled between two rounds"
        assert served.count_prompt_tokens(GenerationRequest(prompt="still serving")) > 0


def test_the_template_file_is_a_bounded_regular_file_that_renders_messages(tmp_path: Path) -> None:
    """``chat.template_path``: /dev/zero exhausted memory, a FIFO hung configure, any readable text
    file became every chat turn's prompt; now each is refused with the reason."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    secret = tmp_path / "secret.txt"
    secret.write_text("wifi password: correct-horse-battery-staple")
    big = tmp_path / "big.jinja"
    big.write_text("{{ messages }}" + " " * (MAX_TEMPLATE_BYTES + 1))
    for path, reason in (("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                         (big, "bytes allowed"), (secret, "does not render `messages`")):
        with pytest.raises(TemplateError, match=reason):
            template_file(str(path))
    good = tmp_path / "chat.jinja"
    good.write_text(GEMMA3_STYLE)
    assert template_file(str(good)).reads_messages


@pytest.mark.parametrize("source, reason", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}", "items"),
    ("{% for c in 'x' * 100000 %}{% for d in 'y' * 100000 %}{% endfor %}{% endfor %}{{ messages }}", "items"),
    ("{{ 10 ** 100000000 }}{{ messages }}", "power above 64"),
    ("{% set ns = namespace(n=0) %}{% for c in (messages[0].content * 2000)|list %}"
     "{% for d in (messages[0].content * 2000)|list %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}",
     "took more than"),
])
def test_a_template_that_runs_away_is_refused(source: str, reason: str) -> None:
    """A template file is a program run in a goal callback: loops that would run for minutes (1e10
    iterations) are stopped by the items a render may make and by its deadline."""
    view = {"messages": [{"role": "user", "content": "hi"}], "tools": None}
    with pytest.raises(TemplateError, match=reason):
        ChatTemplate(source).render(view)


def test_the_goal_check_never_runs_llama_cpps_special_parsing_over_client_text(
        chat_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's special-token parsing scans a text once per special token of the vocabulary (and
    walks its fragment list once per marker found): a tool enum value of 60,000 ``<`` cost 5.5 s of
    the goal callback with Gemma's 6,250 control tokens, 40,000 empty messages a minute. The chat
    layer now finds control-token text in one scan (llama/special_texts.py); llama.cpp parses
    special tokens only in the template's own short texts, never in a client's."""
    parsed: List[int] = []
    real_tokenize = LlamaModel.tokenize

    def recording(self: LlamaModel, text: str, *, add_special: bool = True, parse_special: bool = False) -> List[int]:
        if parse_special:
            parsed.append(len(text))
        return real_tokenize(self, text, add_special=add_special, parse_special=parse_special)

    with engine_of(chat_models["gemma4"]) as served:
        served.count_prompt(turn(tools_json("pair", PAIR)))  # the chat layer is made: markers looked up
        monkeypatch.setattr(LlamaModel, "tokenize", recording)
        hostile = {"type": "object", "properties": {"x": {"enum": ["<" * 60000]}}}
        counted = served.count_prompt(turn(tools_json("go", hostile)))
        many = Conversation(tuple(ChatMessage("user" if i % 2 == 0 else "assistant", "") for i in range(1001)),
                            (), "auto", False)
        served.count_prompt(GenerationRequest(conversation=many, max_tokens=8))
    assert counted.n_tokens > 60000 // 8
    assert max(parsed, default=0) < 100, parsed
