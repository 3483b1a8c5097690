"""A chat turn that may make one call ends where the call closes, whatever ``tool_choice`` says.

With ``tool_choice`` auto and ``parallel_tool_calls`` false (LangChain's ``bind_tools`` default),
the JSON-call grammar let whitespace follow the call (``TAIL: /[ \\t\\n]*/``): a model that writes
newlines there ran on to max_tokens, and the parser threw the text away (an agent suite measured
0.78 s for a required turn, 5.3 s for the same call with auto at 128 max_tokens). After the call the
grammar now allows the end of the turn only, as it does for required and a named tool; with
parallel calls it allows another call or text.

On the embedded Gemma 3 270M with the agent suite's template (calls as JSON in tags), grammar by
grammar, and whole turns of a few-shot conversation (earlier turns that called a skill) in every
mode the model can run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List

import pytest

from gemma_spec_dev.bench.agent_suite import TEMPLATE
from gemma_spec_ros.engine.chat import ChatMessage, Conversation, ToolCall, parse_tools
from gemma_spec_ros.engine.chat.syntax import TAGGED_JSON_CALLS
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.grammar.matcher import GrammarVocab, compiled_constraint
from gemma_spec_ros.engine.request import GenerationRequest
from support.chat import SKILLS_JSON

MODES = ("off", "lookup", "suffix", "suffix+lookup", "auto")


@pytest.fixture(scope="module")
def engine(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    template = tmp_path_factory.mktemp("turn-end") / "agent_suite.jinja"
    template.write_text(TEMPLATE)
    config = EngineConfig(target=ModelConfig(str(embedded_model_path), n_ctx=2048),
                          spec=SpecConfig(mode="off", draft_max=8), prepare_grammar=True,
                          chat=ChatConfig(template_path=str(template)))
    with Engine(config, calibrate=False) as served:
        yield served


def few_shot(choice: str, parallel: bool = False) -> Conversation:
    """Two earlier turns that each called move_to, then a third request of the same kind."""
    messages: List[ChatMessage] = [ChatMessage("system", "You control a robot. Always answer with a tool call.")]
    for i, place in enumerate(("kitchen", "dock")):
        call = ToolCall(f"call_{i}", "move_to", json.dumps({"place": place}))
        messages += [ChatMessage("user", f"Go to the {place}."), ChatMessage("assistant", "", tool_calls=(call,)),
                     ChatMessage("tool", '{"ok": true}', tool_call_id=f"call_{i}")]
    messages.append(ChatMessage("user", "Go to the lab."))
    return Conversation(tuple(messages), parse_tools(SKILLS_JSON), choice, parallel)


@pytest.mark.parametrize("parallel", [False, True])
def test_after_the_one_allowed_call_the_grammar_allows_only_the_end(engine: Engine, parallel: bool) -> None:
    """Text, then a call, through the auto grammar: with one call allowed only an end-of-turn token
    may follow (before: any whitespace, without end); with parallel calls, text or another call."""
    tools = parse_tools(SKILLS_JSON)
    lark = TAGGED_JSON_CALLS.grammar(tools, must_call=False, parallel=parallel)
    grammar = GrammarVocab.of(engine.target).start(compiled_constraint(lark=lark))
    reply = "On my way. " + TAGGED_JSON_CALLS.write("move_to", {"place": "lab"})
    for token in engine.target.tokenize(reply, add_special=False):
        grammar.accept(token)
    allowed = grammar.allowed()
    newline = engine.target.tokenize("\n", add_special=False)[0]
    eog = [t for t in range(engine.target.n_vocab) if engine.target.is_eog(t) and t in allowed]
    assert grammar.complete() and eog
    assert (newline in allowed) is parallel
    if not parallel:
        assert int(allowed.dense().sum()) == len(eog)
    grammar.close()


@pytest.mark.parametrize("mode", MODES)
def test_an_auto_turn_ends_where_its_one_call_closes(engine: Engine, mode: str) -> None:
    """The same conversation with auto and with required: each ends ``tool_calls`` right after its
    call (the two may call different skills: required's grammar opens the call at once), the auto
    turn in no more tokens than its call takes; never max_tokens."""
    turns = {}
    for choice in ("required", "auto"):
        request = GenerationRequest(conversation=few_shot(choice), max_tokens=128, sampling=SamplingParams(),
                                    spec_mode=mode)
        last = list(engine.generate(request))[-1]
        assert last.reply is not None and last.reply.error == "", (choice, last.reply)
        assert last.reply.finish_reason(last.finish_reason) == "tool_calls", (choice, last.finish_reason)
        turns[choice] = (last.stats.num_generated_tokens, [(c.name, c.arguments) for c in last.reply.tool_calls])
    (tokens, calls), _ = turns["auto"], turns["required"]
    written = TAGGED_JSON_CALLS.write(calls[0][0], json.loads(calls[0][1]))
    assert len(calls) == 1 and tokens <= len(engine.target.tokenize(written, add_special=False)) + 2
