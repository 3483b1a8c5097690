"""Chat turns served by the engine's own loop, in every speculative mode: the turn's constraint
(tool_choice required / a name / auto's lazy grammar), its stop strings, the assistant message read
at the end, and the conversation's KV kept between turns (engine/conversations.py).

Models: the tiny random-weight GGUFs with Gemma 4 / Gemma 3 style templates
(test/support/tiny_chat_gguf.py), F32; the draft modes use a second copy of the same file as the
draft model (same vocabulary; its drafts are the target's own greedy choices). The embedded 270M
model has no chat template: the tests that need one give the template file explicitly.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from gemma_spec_ros.engine.chat import ChatMessage, Conversation, TemplateError, ToolCall, parse_tools
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import PromptTooLongError
from gemma_spec_ros.engine.modes import MODES
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support.chat import SKILLS_JSON, planner_conversation
from support.tiny_chat_gguf import GEMMA3_STYLE, write_tiny_chat_gguf
from support.tiny_eagle3 import write_eagle3_pair
from support.tiny_gemma4 import write_gemma4_pair
from support.tiny_gguf import write_tiny_gguf

#: The modes a target with a draft model of its vocabulary can run (mtp and eagle3 need a Gemma 4
#: assistant or an EAGLE-3 head: test_the_linked_heads_serve_chat_turns_too).
MODEL_MODES = [name for name, mode in MODES.items() if mode.needs in ("", "draft")]


def chat_engine(target: Path, draft: Optional[Path] = None, mode: str = "off", n_ctx: int = 2048,
                template_path: str = "", cache_bytes: int = 64 << 20, spec: Optional[SpecConfig] = None,
                max_running: int = 1) -> Engine:
    config = EngineConfig(target=ModelConfig(str(target), n_ctx=n_ctx, n_threads=1),
                          draft=None if draft is None else ModelConfig(str(draft), n_ctx=n_ctx, n_threads=1),
                          spec=spec or SpecConfig(mode=mode, draft_max=4),
                          chat=ChatConfig(template_path=template_path, conversation_cache_bytes=cache_bytes),
                          max_running=max_running)
    return Engine(config, calibrate=spec is not None)


def chat_request(conversation: Conversation, max_tokens: int = 160, **fields: object) -> GenerationRequest:
    return GenerationRequest(max_tokens=max_tokens, conversation=conversation,
                             sampling=SamplingParams(temperature=0.0), **fields)


def run(engine: Engine, request: GenerationRequest, cancel: Optional[threading.Event] = None) -> List[Step]:
    return list(engine.generate(request, cancel))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("chat-engine")
    gemma4 = write_tiny_chat_gguf(folder / "gemma4-style.gguf")
    return {"gemma4": gemma4, "draft": write_tiny_chat_gguf(folder / "gemma4-style-draft.gguf"),
            "gemma3": write_tiny_chat_gguf(folder / "gemma3-style.gguf", template=GEMMA3_STYLE, seed=1),
            "plain": write_tiny_gguf(folder / "no-template.gguf", vocab_size=128, n_layer=1),
            "folder": folder}


@pytest.fixture(scope="module")
def engine(files: dict) -> Iterator[Engine]:
    """The Gemma 4 style model with a draft of its own vocabulary: every mode of MODEL_MODES runs."""
    served = chat_engine(files["gemma4"], files["draft"])
    yield served
    served.close()


def test_the_modes_under_test_are_every_mode() -> None:
    """MODEL_MODES and the linked heads' test cover the whole mode table."""
    assert set(MODEL_MODES) | {"mtp", "eagle3"} == set(MODES)


@pytest.mark.parametrize("mode", MODEL_MODES)
@pytest.mark.parametrize("choice", ["required", "pick", "auto"])
def test_a_turn_in_every_mode_returns_valid_calls_or_text(engine: Engine, mode: str, choice: str) -> None:
    """The loop serves the turn under its constraint in each mode: a required call (or the named
    tool's) parses and validates, the last step carries it with finish_reason tool_calls; an auto
    turn is text or valid calls, and the streamed text is the message's text."""
    conversation = planner_conversation(choice)
    steps = run(engine, chat_request(conversation, spec_mode=mode))
    last = steps[-1]
    reply = last.reply
    assert reply is not None and reply.error == "", (mode, reply)
    assert all(step.reply is None for step in steps[:-1])
    assert "".join(step.text for step in steps).strip() == reply.content
    assert last.spec_mode.split(":")[0] == mode
    if choice != "auto":
        assert last.finish_reason == "stop" and reply.finish_reason(last.finish_reason) == "tool_calls"
        assert len(reply.tool_calls) == 1 and choice in ("required", reply.tool_calls[0].name)
        assert last.stats.num_grammar_masks > 0
    for call in reply.tool_calls:
        assert call.name in ("move_to", "pick", "say") and isinstance(json.loads(call.arguments), dict)


@pytest.mark.exact
@pytest.mark.parametrize("mode", MODEL_MODES)
def test_every_mode_writes_the_turn_that_off_writes(exact_build: None, engine: Engine, mode: str) -> None:
    """Greedy decoding is lossless under speculation: each mode's tokens for a turn with parallel
    calls (the constraint's forced drafts and the drafters' alike) are off's, token for token (F32
    weights, the exact build)."""
    request = chat_request(planner_conversation("required", parallel=True), max_tokens=96, reuse_prompt=False)
    off = [t for step in run(engine, request) for t in step.tokens]
    spec = [t for step in run(engine, replace(request, spec_mode=mode)) for t in step.tokens]
    assert spec == off


def test_the_turn_is_drafted_in_the_draft_modes(engine: Engine) -> None:
    """Tool-call JSON is predictable: a draft model of the target's own weights drafts it and the
    drafts are accepted, so the turn takes fewer target passes than tokens."""
    steps = run(engine, chat_request(planner_conversation("required"), spec_mode="draft"))
    stats = steps[-1].stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_steps < stats.num_generated_tokens


@pytest.mark.parametrize("kind, write_pair", [("mtp", write_gemma4_pair), ("eagle3", write_eagle3_pair)])
def test_the_linked_heads_serve_chat_turns_too(files: dict, kind: str, write_pair: object) -> None:
    """spec.mode mtp and eagle3 (the tiny Gemma 4 target with its assistant / head, the template
    given as a file): the turn's call validates, the head drafts, and a follow-up after another
    conversation gets its KV back (the head's own state follows the target's)."""
    target, head = write_pair(files["folder"] / kind)
    template = files["folder"] / f"{kind}.jinja"
    template.write_text(GEMMA3_STYLE)
    spec = SpecConfig(mode=kind, draft_max=3, p_min=0.0, adaptive=False)
    with chat_engine(target, head, template_path=str(template), spec=spec) as served:
        a1 = planner_conversation("say")
        first = run(served, chat_request(a1, max_tokens=200))[-1]
        run(served, chat_request(replace(conversation_b(), tool_choice="say"), max_tokens=200))
        second = run(served, chat_request(follow_up(a1, first), max_tokens=200))[-1]
    for last in (first, second):
        assert last.reply is not None and last.reply.error == "" and last.reply.tool_calls[0].name == "say"
        assert last.stats.num_drafts > 0 and last.spec_mode == kind
    assert second.stats.num_prompt_tokens_reused >= first.stats.num_prompt_tokens


def test_the_gemma3_style_template_gets_calls_in_tags(files: dict) -> None:
    """A template without tools: the fallback's tagged JSON, through the loop in a speculative mode."""
    with chat_engine(files["gemma3"], mode="suffix") as served:
        last = run(served, chat_request(planner_conversation("move_to")))[-1]
    assert last.reply is not None and last.reply.error == ""
    assert [c.name for c in last.reply.tool_calls] == ["move_to"]


@pytest.mark.parametrize("mode", ["off", "lookup", "suffix", "draft", "auto"])
def test_a_follow_up_evaluates_only_its_new_tokens_after_another_conversation(files: dict, mode: str) -> None:
    """Two conversations take turns (A, B, A): A's second turn gets A's KV back from its snapshot
    and reuses every token of its first turn's prompt; without the conversation cache it reuses
    only what it shares with B (the system turn and the tools, not the whole first turn)."""
    def turns(cache_bytes: int) -> List[int]:
        with chat_engine(files["gemma4"], files["draft"], mode=mode, cache_bytes=cache_bytes) as served:
            a1, b1 = planner_conversation("required"), conversation_b()
            first = run(served, chat_request(a1))[-1]
            run(served, chat_request(b1))
            a2 = follow_up(a1, first)
            second = run(served, chat_request(a2))[-1]
            assert second.reply is not None and second.reply.error == ""
            kept = len(served.conversations)
            return [first.stats.num_prompt_tokens, second.stats.num_prompt_tokens_reused,
                    second.stats.num_prompt_tokens, kept]

    n_first, reused, n_second, kept = turns(64 << 20)
    assert reused >= n_first and n_second > reused and kept == 2
    _, reused_without, _, kept_without = turns(0)
    assert kept_without == 0 and reused_without < n_first  # only the prefix it shares with B


@pytest.mark.parametrize("holder", [0, 1])
def test_turns_served_at_once_keep_their_conversations_in_any_sequence(files: dict, holder: int) -> None:
    """Several requests at once (max_running 2): conversations A and B run together, then two
    others take both sequences; A's follow-up, while a long turn of one of the two holds its
    sequence, gets A's KV back from its snapshot into the other sequence and reuses every token
    of its first turn's prompt (each of the two runs it in another sequence)."""
    def together(engine: Engine, conversations: List[Conversation]) -> List[Step]:
        lasts: List[Optional[Step]] = [None] * len(conversations)

        def serve(i: int) -> None:
            lasts[i] = run(engine, chat_request(conversations[i]))[-1]
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(conversations))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert all(last is not None and last.reply is not None and last.reply.error == "" for last in lasts)
        return lasts  # type: ignore[return-value]

    others = [replace(conversation_b(), messages=conversation_b().messages[:1]
                      + (ChatMessage("user", f"Go to room {room} and report what you see."),))
              for room in (3, 4)]
    with chat_engine(files["gemma4"], mode="suffix", max_running=2) as served:
        a1 = planner_conversation("required")
        first, _ = together(served, [a1, conversation_b()])
        together(served, others)
        # a request's last step reaches its reader before its slot is released (its snapshot is
        # saved after it): wait for both, so that the long turn finds its own sequence free
        deadline = time.monotonic() + 30
        while not served.status()["requests running"].startswith("0 ") and time.monotonic() < deadline:
            time.sleep(0.01)
        restored = served.conversations.restored
        started, done = threading.Event(), threading.Event()

        def long_turn() -> None:  # holds the first free sequence while A's follow-up runs
            # the same prompt as others[holder]'s: the sequence that served it takes it
            long = chat_request(replace(others[holder], tool_choice="none"), max_tokens=1200,
                                json_schema='{"type": "string", "minLength": 8000}')  # no early end
            for _ in served.generate(long):
                started.set()
                if done.is_set():
                    break
        holding = threading.Thread(target=long_turn)
        holding.start()
        assert started.wait(timeout=120)
        try:
            second = run(served, chat_request(follow_up(a1, first)))[-1]
        finally:
            done.set()
            holding.join(timeout=120)
        assert second.reply is not None and second.reply.error == ""
        # A's snapshot was restored (the long turn may have restored its own too: when the two
        # others ran one after the other, the second may have taken the first's sequence)
        assert served.conversations.restored >= restored + 1
        assert second.stats.num_prompt_tokens_reused >= first.stats.num_prompt_tokens


def conversation_b() -> Conversation:
    return Conversation((ChatMessage("system", "You are the task planner of a mobile robot."),
                         ChatMessage("user", "Say hello to the guests at the door, then wait.")),
                        parse_tools(SKILLS_JSON), "required")


def follow_up(conversation: Conversation, last: Step) -> Conversation:
    """The conversation with the turn's calls, a result for each, and the next user message."""
    assert last.reply is not None
    calls = last.reply.tool_calls
    results = tuple(ChatMessage("tool", '{"ok": true}', tool_call_id=c.id) for c in calls)
    messages = conversation.messages + (ChatMessage("assistant", last.reply.content, tool_calls=calls),
                                        *results, ChatMessage("user", "Next step."))
    return replace(conversation, messages=messages)


@pytest.mark.parametrize("model", ["gemma4", "gemma3"])
def test_a_closing_text_turn_reuses_the_call_turns_prompt(files: dict, model: str) -> None:
    """tool_choice none after a required turn (the agent loop's last turn), with the native
    template and with the fallback: the prompt still shows the tools, so the text turn reuses
    every token of the call turn's prompt, and its reply is text."""
    with chat_engine(files[model], mode="suffix") as served:
        a1 = planner_conversation("required")
        first = run(served, chat_request(a1))[-1]
        closing = replace(follow_up(a1, first), tool_choice="none")
        second = run(served, chat_request(closing, max_tokens=16))[-1]
    assert first.reply is not None and first.reply.tool_calls and first.reply.error == ""
    assert second.reply is not None and second.reply.tool_calls == ()
    assert second.stats.num_prompt_tokens_reused >= first.stats.num_prompt_tokens


def test_the_snapshots_stay_within_their_bound_least_recently_used_out(files: dict) -> None:
    """Room for one and a half snapshots: after three conversations only the last one's is kept."""
    conversations = [Conversation((ChatMessage("user", f"Task {i}: say hi " * 4),), parse_tools(SKILLS_JSON),
                                  "required") for i in range(3)]
    with chat_engine(files["gemma4"], cache_bytes=1 << 30) as served:
        run(served, chat_request(conversations[0]))
        one = served.conversations.bytes
    with chat_engine(files["gemma4"], cache_bytes=int(one * 1.5)) as served:
        prompts = [served.count_prompt(chat_request(c)).tokens for c in conversations]
        for conversation in conversations:
            run(served, chat_request(conversation))
        kept = served.conversations.keys()
        assert served.conversations.bytes <= served.conversations.max_bytes
        assert len(kept) == 1 and kept[0][:len(prompts[2])] == prompts[2]


def test_a_stop_string_ends_the_message_text(files: dict) -> None:
    """Stop strings end a text reply: the message ends before the match, finish_reason stop (the
    Gemma 3 style model writes text at length in an auto turn)."""
    with chat_engine(files["gemma3"], mode="suffix") as served:
        probe = run(served, chat_request(planner_conversation("auto"), max_tokens=24))[-1]
        text = probe.reply.content
        assert len(text) >= 8 and probe.finish_reason == "length", text
        stop = text[4:7]
        last = run(served, chat_request(planner_conversation("auto"), max_tokens=24, stop=(stop,)))
    content = last[-1].reply.content
    assert last[-1].finish_reason == "stop" and stop not in content and text.startswith(content)
    assert "".join(step.text for step in last).strip() == content


def test_a_cancelled_turn_ends_with_its_text_and_no_false_error(engine: Engine) -> None:
    cancel = threading.Event()
    cancel.set()
    last = run(engine, chat_request(planner_conversation("required")), cancel)[-1]
    assert last.finish_reason == "cancelled" and last.reply is not None
    assert last.reply.tool_calls == () and last.reply.error == ""


def test_a_turn_cut_by_max_tokens_says_so(engine: Engine) -> None:
    last = run(engine, chat_request(planner_conversation("required"), max_tokens=3))[-1]
    assert last.finish_reason == "length" and last.reply.tool_calls == ()
    assert last.reply.error.startswith("max_tokens ran out inside a tool call")


def test_refusals_before_generation(files: dict, engine: Engine) -> None:
    """What the node refuses at goal time, raised by count_prompt / check_request: a model without
    a template, a conversation over the context, a grammar beside tools."""
    with chat_engine(files["plain"]) as plain:
        with pytest.raises(TemplateError, match="has no chat template"):
            plain.count_prompt(chat_request(planner_conversation()))
    long = replace(planner_conversation(), messages=planner_conversation().messages
                   + (ChatMessage("user", "again " * 400),))
    request = chat_request(long)
    with pytest.raises(PromptTooLongError, match="exceeds the context of 2048 tokens"):
        engine.check_request(request, engine.count_prompt(request).n_tokens)
    with pytest.raises(ValueError, match="grammar / json_schema constrain a reply without tools"):
        engine.count_prompt(chat_request(planner_conversation(), json_schema='{"type": "object"}'))
    with pytest.raises(ValueError, match="prompt, system_prompt and use_chat_template stay empty"):
        GenerationRequest("hi", conversation=planner_conversation())


def test_a_template_file_serves_a_model_without_one(files: dict) -> None:
    """chat.template_path: a model without tokenizer.chat_template chats in the file's template; a
    file that does not compile fails the engine's load with the reason."""
    template = files["folder"] / "gemma3-style.jinja"
    template.write_text(GEMMA3_STYLE)
    with chat_engine(files["plain"], template_path=str(template), mode="lookup") as served:
        last = run(served, chat_request(planner_conversation("say"), max_tokens=200))[-1]
    assert last.reply is not None and last.reply.error == "" and last.reply.tool_calls[0].name == "say"
    broken = files["folder"] / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(TemplateError, match=f"the chat template file {broken} does not compile"):
        chat_engine(files["plain"], template_path=str(broken))
    with pytest.raises(TemplateError, match="cannot read the chat template file"):
        chat_engine(files["plain"], template_path=str(files["folder"] / "missing.jinja"))


def test_a_chat_turn_and_a_prompt_share_the_engine(engine: Engine) -> None:
    """A Generate request between two turns of a conversation: it runs as always, and the
    conversation's next turn still gets its KV back."""
    a1 = planner_conversation("required")
    first = run(engine, chat_request(a1))[-1]
    plain = run(engine, GenerationRequest("The robot", max_tokens=8))
    assert plain[-1].reply is None and plain[-1].finish_reason in ("stop", "length")
    second = run(engine, chat_request(follow_up(a1, first)))[-1]
    assert second.stats.num_prompt_tokens_reused >= first.stats.num_prompt_tokens
    assert engine.status()["conversations kept"] >= 1


def test_calls_in_the_history_are_kept_as_given(engine: Engine) -> None:
    """An earlier call with its id and a result: the next turn's prompt holds them, and the ids of
    the new calls are fresh."""
    conversation = planner_conversation("required")
    last = run(engine, chat_request(conversation))[-1]
    assert all(c.id != "call_1" for c in last.reply.tool_calls)
    assert isinstance(conversation.messages[2].tool_calls[0], ToolCall)
