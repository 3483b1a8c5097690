"""Chat turns on the remote backend: the turn's request to /v1/chat/completions (messages, tools,
tool_choice), the server's streamed calls put together and validated as the local engine's are.

Servers: llama.cpp's real llama-server on the embedded model with the agent suite's template given
as its chat template (the model has none): a required turn, opened by the template's call tag, is
a valid call; sent plainly, the base model writes text until max_tokens (llama-server's grammar for
tagged JSON calls lets text precede a required call); and a scripted stream
(:class:`support.servers.ScriptedStreamServer`, a fake) for what the real model does not produce on
demand: fragments of two calls, one whose arguments fail its schema.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest

from gemma_spec_dev.bench.agent_suite import SKILLS, SYSTEM, TASKS, TEMPLATE
from gemma_spec_ros.engine.chat import conversation_from_json
from gemma_spec_ros.engine.config import SamplingParams, SpecConfig
from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support.chat import SKILLS_JSON
from support.servers import LLAMA_SERVER, SSE_CHUNKED_HEAD, ScriptedStreamServer, Server, chunk, llama_server


def turn(choice: str, max_tokens: int = 24, parallel: bool = False) -> GenerationRequest:
    conversation = conversation_from_json({"messages": [{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": TASKS[0]}],
                                           "tools": SKILLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    return GenerationRequest(conversation=conversation, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, embedded_model_path: Path) -> Iterator[Server]:
    if not LLAMA_SERVER.is_file():
        pytest.fail(f"no llama-server at {LLAMA_SERVER}: scripts/build_native_tools.sh builds it")
    folder = tmp_path_factory.mktemp("remote_chat")
    template = folder / "agent_suite.jinja"
    template.write_text(TEMPLATE)
    srv = llama_server(embedded_model_path, folder, ["--jinja", "--chat-template-file", str(template), "-c", "2048"])
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.timeout(300)
def test_a_required_turn_on_llama_server_is_a_valid_call(server: Server) -> None:
    """The turn reaches the server as a chat completion with the tools, the assistant's reply
    opened by the template's call tag (the server's /props named it): the base model's reply is
    one call that validates, ended by the closing tag (one call allowed)."""
    engine = RemoteEngine(RemoteConfig(url=server.url, probe_period=0), SpecConfig())
    steps: List[Step] = list(engine.generate(turn("required", max_tokens=48)))
    last = steps[-1]
    assert last.reply is not None and last.reply.error == "", last.reply
    assert len(last.reply.tool_calls) == 1 and last.reply.tool_calls[0].name in {t["function"]["name"] for t in SKILLS}
    assert last.reply.finish_reason(last.finish_reason) == "tool_calls"
    assert last.stats.time_to_first_token > 0 and last.stats.num_prompt_tokens > 200
    again = list(engine.generate(turn("required", max_tokens=48)))[-1]  # the server's cache serves it
    assert again.reply is not None
    assert [(c.name, c.arguments) for c in again.reply.tool_calls] == [(c.name, c.arguments) for c in last.reply.tool_calls]
    assert again.stats.num_prompt_tokens - 2 <= again.stats.num_prompt_tokens_reused < again.stats.num_prompt_tokens


@pytest.mark.timeout(300)
def test_a_required_turn_sent_plainly_runs_out_in_text(server: Server) -> None:
    """Why the turn is opened by the tag: without it (a server whose template's call syntax is not
    known), the base model writes text, which llama-server's grammar lets precede a required call,
    until max_tokens; the text streams and the reply says that no tool was called."""
    engine = RemoteEngine(RemoteConfig(url=server.url, probe_period=0), SpecConfig())
    assert engine.server.call_syntax is not None
    engine.server.call_syntax = None  # as for a template whose syntax is neither known one
    steps: List[Step] = list(engine.generate(turn("required")))
    last = steps[-1]
    assert last.finish_reason == "length" and last.reply is not None
    assert last.reply.tool_calls == () and "tool_choice required but the reply calls no tool" in last.reply.error
    assert "".join(s.text for s in steps).strip() == last.reply.content != ""


def scripted(chunks: List[Any]) -> Callable[[Callable[[bytes], bool]], None]:
    """A chat-completion stream of ``chunks`` (JSON objects), then [DONE]."""
    def script(send: Callable[[bytes], bool]) -> None:
        send(SSE_CHUNKED_HEAD)
        for payload in chunks:
            send(chunk(b"data: " + json.dumps(payload).encode() + b"\n\n"))
        send(chunk(b"data: [DONE]\n\n") + chunk(b""))
    return script


def call_fragment(index: int, **function: str) -> dict:
    return {"choices": [{"delta": {"tool_calls": [{"index": index, "id": f"srv{index}", "function": function}]},
                         "finish_reason": None}]}


def test_streamed_calls_are_put_together_and_validated() -> None:
    """Two calls in fragments (a fake server: see the module docstring) of a turn that may make
    several: the valid one is in the message with its arguments, the one whose place is not in its
    enum is left out with the reason; finish_reason tool_calls; the request carried the tools,
    tool_choice and messages. With one call allowed, the second is not read (the next test)."""
    chunks = [{"choices": [{"delta": {"content": "On it."}, "finish_reason": None}]},
              call_fragment(0, name="navigate", arguments='{"place": '),
              call_fragment(0, arguments='"sink"}'),
              call_fragment(1, name="navigate", arguments='{"place": "garage"}'),
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}], "usage": {"completion_tokens": 20,
                                                                                   "prompt_tokens": 300}}]
    with ScriptedStreamServer(scripted(chunks), routes={"POST /v1/chat/completions": scripted(chunks)}) as fake:
        engine = RemoteEngine(RemoteConfig(url=fake.url, probe_period=0), SpecConfig())
        last = list(engine.generate(turn("required", parallel=True)))[-1]
        body = json.loads(fake.bodies("POST /v1/chat/completions")[0])
    reply = last.reply
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("navigate", {"place": "sink"})]
    assert reply.content == "On it." and "'garage' is not one of" in reply.error
    assert reply.finish_reason(last.finish_reason) == "tool_calls"
    assert body["tool_choice"] == "required" and len(body["tools"]) == len(SKILLS)
    assert [m["role"] for m in body["messages"]] == ["system", "user"] and body["stream"] is True
    assert last.stats.time_to_first_token > 0  # the first delta, text or call, counts


def test_the_local_fallback_serves_a_chat_turn_when_the_server_is_unreachable(tmp_path: Path) -> None:
    """remote.fallback local: an unreachable server, and the turn is served by the local engine
    (the tiny Gemma 4 style model), its call validated as always."""
    from gemma_spec_ros.engine.config import EngineConfig, ModelConfig
    from gemma_spec_ros.engine.engine import Engine
    from gemma_spec_ros.engine.fallback import FallbackEngine
    from support.chat import planner_conversation
    from support.servers import free_port
    from support.tiny_chat_gguf import write_tiny_chat_gguf

    local = Engine(EngineConfig(target=ModelConfig(str(write_tiny_chat_gguf(tmp_path / "chat.gguf")), n_ctx=2048,
                                                   n_threads=1)), calibrate=False)
    engine = FallbackEngine(RemoteEngine(RemoteConfig(url=f"http://127.0.0.1:{free_port()}", connect_timeout=0.5,
                                                      probe_period=0), SpecConfig()), local)
    try:
        request = GenerationRequest(conversation=planner_conversation("pick"), max_tokens=160)
        last = list(engine.generate(request))[-1]
        assert engine.status()["served by"] == "local"
        assert last.reply is not None and last.reply.error == "" and last.reply.tool_calls[0].name == "pick"
    finally:
        engine.close()


# -- what a server sends for its calls -------------------------------------------------------------
def stream_calls(fragments: List[Any], parallel: bool = True) -> Step:
    """The last Step of a required turn whose stream is ``fragments`` (chunks) and a last chunk."""
    chunks = fragments + [{"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}]
    with ScriptedStreamServer(scripted(chunks), routes={"POST /v1/chat/completions": scripted(chunks)}) as fake:
        engine = RemoteEngine(RemoteConfig(url=fake.url, probe_period=0), SpecConfig())
        try:
            return list(engine.generate(turn("required", parallel=parallel)))[-1]
        finally:
            engine.close()


def test_with_one_call_allowed_the_turn_ends_where_the_server_goes_on() -> None:
    """A server that goes on after the one allowed call (a second call, or text: llama-server's
    grammar let a model do both, to max_tokens) ends the turn there: the first call is the reply."""
    first = [call_fragment(0, name="navigate", arguments='{"place": '), call_fragment(0, arguments='"sink"}')]
    for after in (call_fragment(1, name="say", arguments='{"text": "'),
                  {"choices": [{"delta": {"content": " and then"}, "finish_reason": None}]}):
        last = stream_calls(first + [after] * 3, parallel=False)
        assert last.reply is not None and last.reply.error == "", last.reply
        assert [(c.name, json.loads(c.arguments)) for c in last.reply.tool_calls] == [("navigate", {"place": "sink"})]
        assert last.reply.content == "" and last.reply.finish_reason(last.finish_reason) == "tool_calls"


@pytest.mark.parametrize("fragment, needle", [
    (call_fragment(0, name=5, arguments="{}"), r"tool_calls\[0\]\.function\.name as int \(5\), expected a string"),
    (call_fragment(0, name="navigate", arguments={"place": "sink"}),
     r"tool_calls\[0\]\.function\.arguments as dict \(\{'place': 'sink'\}\), expected a string \(JSON text\)"),
    ({"choices": [{"delta": {"tool_calls": [{"index": "0", "function": {"name": "navigate"}}]}}]},
     r"tool_calls\[0\]\.index as str \(0\), expected a whole number >= 0"),
    ({"choices": [{"delta": {"tool_calls": [{"index": True, "function": {"name": "navigate"}}]}}]},
     r"tool_calls\[0\]\.index as bool \(True\)"),
    ({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": ["navigate"]}]}}]},
     r"tool_calls\[0\]\.function as list \(\['navigate'\]\), expected an object"),
    ({"choices": [{"delta": {"tool_calls": ["navigate"]}}]},
     r"tool_calls\[0\] as str \(navigate\), expected an object"),
])
def test_a_call_field_of_another_type_ends_the_turn_with_the_reason(fragment: Any, needle: str) -> None:
    """A call's name as a number, or its arguments as an object rather than JSON text, raised
    TypeError (`+=` on a str) while the stream was read: the goal ended as an internal error. Now
    each field's type is checked as it comes, and the turn ends with a RemoteError naming it."""
    from gemma_spec_ros.engine.remote import RemoteError
    with pytest.raises(RemoteError, match=needle):
        stream_calls([fragment])


@pytest.mark.parametrize("depth", [990, 5000])
def test_deeply_nested_arguments_are_a_call_left_out_with_the_reason(depth: int) -> None:
    """Arguments nested 5,000 deep raised RecursionError from json.loads (only ValueError was
    caught), and 990 deep parsed here but raised ValueError in ToolCall's own check a few frames
    deeper: both ended the goal as an internal error. Now such a call is left out with the reason,
    as a call whose arguments are not JSON is, and the valid call before it is kept."""
    nested = '{"place": "sink", "x": ' + "[" * depth + "]" * depth + "}"
    last = stream_calls([call_fragment(0, name="navigate", arguments='{"place": "dock"}'),
                         call_fragment(1, name="navigate", arguments=nested)])
    reply = last.reply
    assert reply is not None
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("navigate", {"place": "dock"})]
    assert reply.error == "the server's call of 'navigate' has arguments nested more than 32 levels deep"


def _join_fragments(count: int) -> float:
    """Seconds to take ``count`` argument fragments of 256 bytes of one call and read the call."""
    from gemma_spec_ros.engine.remote.chat import ToolCallDeltas
    calls = ToolCallDeltas()
    calls.add(call_fragment(0, name="say", arguments='{"text": "'))
    piece = call_fragment(0, arguments="y" * 256)
    started = time.perf_counter()
    for _ in range(count):
        calls.add(piece)
    calls.add(call_fragment(0, arguments='"}'))
    parsed = calls.parsed("")
    elapsed = time.perf_counter() - started
    assert parsed.error == "" and len(parsed.calls[0][1]["text"]) == 256 * count
    return elapsed


def test_many_small_fragments_are_joined_in_linear_time() -> None:
    """Fragments were joined with `+=` on a dict entry, a copy of the arguments so far each time:
    10,000 fragments of 256 bytes took ~5 s and 40,000 ~100 s (quadratic: 4x the fragments, 19x the
    time). Now they are kept in a list and joined once: 4x the fragments cost about 4x (the bound,
    8x, sits between the two growth rates), and 40,000 take well under a second."""
    small, large = _join_fragments(10_000), _join_fragments(40_000)
    assert large < 5.0 and large / small < 8.0, (small, large)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("choice", ["auto", "required", "move_to"])
def test_a_turn_with_one_call_allowed_ends_at_the_call_on_llama_server(server: Server, choice: str) -> None:
    """tool_choice auto, required or a tool's name, parallel_tool_calls false, through the remote
    backend: the turn ends with its one call (finish_reason tool_calls), not at max_tokens."""
    messages = [{"role": "system", "content": "You control a robot. Always answer with a tool call."}]
    for i, place in enumerate(("kitchen", "dock")):
        messages += [{"role": "user", "content": f"Go to the {place}."},
                     {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                         "name": "move_to", "arguments": json.dumps({"place": place})}}]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"ok": true}'}]
    messages.append({"role": "user", "content": "Go to the lab."})
    conversation = conversation_from_json({"messages": messages, "tools": json.loads(SKILLS_JSON), "tool_choice": choice,
                                           "parallel_tool_calls": False})
    engine = RemoteEngine(RemoteConfig(url=server.url, probe_period=0), SpecConfig())
    last = list(engine.generate(GenerationRequest(conversation=conversation, max_tokens=128,
                                                  sampling=SamplingParams(temperature=0.0))))[-1]
    assert last.reply is not None and last.reply.error == "", last.reply
    assert last.reply.finish_reason(last.finish_reason) == "tool_calls" and len(last.reply.tool_calls) == 1
    assert last.stats.num_generated_tokens < 64
