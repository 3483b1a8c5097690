"""gemma-spec-export-traffic: a request log (written by engine/request_log.py from real requests and
replies) as the datasets the draft-head trainers read. Each format is checked by a reader written
from the trainers' documented schemas (test/support/trainer_readers.py: SpecForge's data preparation
page and its conversation parser's role rules; ShareGPT's from/value; OpenAI's messages), not by the
exporter's own check."""
from __future__ import annotations

import doctest
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from gemma_spec_ros.engine.chat import (TAGGED_JSON_CALLS, AssistantReply, ChatMessage, Conversation,
                                        ToolCall, parse_tools)
from gemma_spec_ros.engine.chat.template import fallback_messages
from gemma_spec_ros.engine.config import SamplingParams
from gemma_spec_ros.engine.request import GenerationRequest, Step
from gemma_spec_ros.engine.request_log import HEADER, open_log
from gemma_spec_ros.engine.stats import SpecStats
from gemma_spec_ros.tools import export_traffic
from gemma_spec_ros.tools.export_traffic import main
from support.trainer_readers import check_roles, sharegpt_reader_accepts, specforge_reader_accepts

TOOLS_JSON = json.dumps([{"type": "function", "function": {
    "name": "move_to", "description": "Drive to a place.",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}}}])
TOOLS = parse_tools(TOOLS_JSON)
SYSTEM = ChatMessage("system", "You are the planner of a mobile robot.")
ASK = ChatMessage("user", "Bring the cup from the kitchen.")
CALL = ToolCall("call_1", "move_to", '{"place": "kitchen"}')


def last_step(finish_reason: str, reply: Any = None) -> Step:
    return Step(tokens=(1,), text="", stats=SpecStats(num_prompt_tokens=9, num_generated_tokens=4),
                spec_mode="lookup", draft_max=4, finish_reason=finish_reason, reply=reply)


def chat(*messages: ChatMessage) -> GenerationRequest:
    return GenerationRequest(conversation=Conversation(tuple(messages), TOOLS, "auto"), max_tokens=64)


#: (request, the text streamed, finish reason, the reply of a chat turn): what a node served.
SERVED = [
    (GenerationRequest("List three fruits.", max_tokens=16, system_prompt="Be brief.", use_chat_template=True,
                       sampling=SamplingParams()), "Apple, pear, plum.", "stop", None),
    (GenerationRequest("The robot drove to", max_tokens=8), " the dock and", "length", None),  # raw prompt
    (chat(SYSTEM, ASK), "", "stop", AssistantReply("On my way.", (CALL,))),
    (chat(SYSTEM, ASK, ChatMessage("assistant", "On my way.", tool_calls=(CALL,)),
          ChatMessage("tool", '{"arrived": true}', name="move_to", tool_call_id="call_1")),
     "I am in the kitchen.", "stop", AssistantReply("I am in the kitchen.")),
    (chat(ASK), "Let me check.", "stop", AssistantReply("Let me check.", (), "a tool call does not parse: ...")),
    (chat(ASK), "", "stop", AssistantReply("")),  # an empty reply: nothing to learn from
    (chat(ASK), "Later.", "cancelled", AssistantReply("Later.")),  # not finished: never recorded
]


@pytest.fixture
def log(tmp_path: Path) -> str:
    traffic = open_log("traffic.jsonl", 1 << 20, str(tmp_path / "cache"), target="target 'gemma.gguf'")
    for request, text, finish_reason, reply in SERVED:
        assert traffic.record(request, text, finish_reason, last_step(finish_reason, reply)) == ""
    return traffic.path


def export(log: str, out: Path, *options: str) -> List[Dict[str, Any]]:
    assert main([log, "-o", str(out), *options]) == 0
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


# -- tests -----------------------------------------------------------------------------------------
def test_doctests() -> None:
    assert doctest.testmod(export_traffic).failed == 0


def test_the_specforge_dataset_holds_the_targets_replies(log: str, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "specforge.jsonl"
    rows = export(log, out)
    for line in out.read_text(encoding="utf-8").splitlines():
        specforge_reader_accepts(line)
    assert "left out 1: replies that left a call out" in capsys.readouterr().err
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4
    plain, raw, called, answered = (r["conversations"] for r in rows)
    assert plain == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List three fruits."},
                     {"role": "assistant", "content": "Apple, pear, plum."}]
    assert raw == [{"role": "user", "content": "The robot drove to"}, {"role": "assistant", "content": " the dock and"}]
    assert called[-1] == {"role": "assistant", "content": "On my way.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "move_to", "arguments": '{"place": "kitchen"}'}}]}
    assert [m["role"] for m in answered] == ["system", "user", "assistant", "tool", "assistant"]
    assert answered[3] == {"role": "tool", "content": '{"arrived": true}', "name": "move_to", "tool_call_id": "call_1"}
    assert answered[-1] == {"role": "assistant", "content": "I am in the kitchen."}
    assert rows[2]["tools"] == json.loads(TOOLS_JSON) and rows[0]["tools"] == []


def test_the_sharegpt_dataset_writes_calls_as_the_node_does_for_a_template_without_tools(
        log: str, tmp_path: Path) -> None:
    out = tmp_path / "sharegpt.jsonl"
    rows = export(log, out, "--format", "sharegpt")
    for line in out.read_text(encoding="utf-8").splitlines():
        sharegpt_reader_accepts(line)
    assert len(rows) == 4
    answered = rows[3]["conversations"]
    conversation = Conversation((SYSTEM, ASK, ChatMessage("assistant", "On my way.", tool_calls=(CALL,)),
                                 ChatMessage("tool", '{"arrived": true}', name="move_to", tool_call_id="call_1"),
                                 ChatMessage("assistant", "I am in the kitchen.")), TOOLS)
    node_wrote = fallback_messages(conversation, TAGGED_JSON_CALLS)  # what a Gemma 3 style prompt holds
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    assert answered == [{"from": names[m.role], "value": m.content} for m in node_wrote]
    assert '<tool_call>\n{"name": "move_to", "arguments": {"place": "kitchen"}}\n</tool_call>' in answered[2]["value"]
    assert rows[2]["conversations"][-1]["value"].endswith("</tool_call>")


def test_the_openai_messages_dataset(log: str, tmp_path: Path) -> None:
    rows = export(log, tmp_path / "messages.jsonl", "--format", "openai-messages")
    assert all(set(r) <= {"id", "messages", "tools"} for r in rows)
    assert rows[2]["messages"][-1]["tool_calls"][0]["function"]["name"] == "move_to"
    for row in rows:
        check_roles([m["role"] for m in row["messages"]], [bool(m.get("tool_calls")) for m in row["messages"]],
                    tools=True)


def test_the_specforge_dataset_can_carry_calls_as_text(log: str, tmp_path: Path) -> None:
    out = tmp_path / "text.jsonl"
    rows = export(log, out, "--tool-calls", "text")
    for line in out.read_text(encoding="utf-8").splitlines():
        row = specforge_reader_accepts(line)
        assert "tools" not in row or row["tools"] == []
        check_roles([m["role"] for m in row["conversations"]], [False] * len(row["conversations"]), tools=False)
    assert "<tool_call>" in rows[2]["conversations"][-1]["content"]


@pytest.mark.parametrize("options, kept", [
    (["--chat-only"], 2),
    (["--skip-raw"], 3),
    (["--skip-length"], 3),
    (["--min-turns", "2"], 1),
    (["--include-errors"], 5),
])
def test_filters(log: str, tmp_path: Path, options: List[str], kept: int) -> None:
    rows = export(log, tmp_path / "out.jsonl", *options)
    assert len(rows) == kept
    if "--include-errors" in options:  # the text the reply kept, the call it left out gone
        assert rows[4]["conversations"][-1] == {"role": "assistant", "content": "Let me check."}


def test_what_is_left_out_is_counted(log: str, tmp_path: Path, capsys: Any) -> None:
    assert len(export(log, tmp_path / "out.jsonl")) == 4
    err = capsys.readouterr().err
    assert "left out 1: conversations a trainer would refuse: an empty reply" in err
    assert "left out 1: replies that left a call out (--include-errors keeps them)" in err


def test_identical_conversations_and_records_read_twice(tmp_path: Path) -> None:
    traffic = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    request, text, finish_reason, _ = SERVED[0]
    for _ in range(3):
        traffic.record(request, text, finish_reason, last_step(finish_reason))
    assert len(export(traffic.path, tmp_path / "all.jsonl")) == 3  # three requests, three times
    assert len(export(traffic.path, tmp_path / "once.jsonl", "--dedupe")) == 1
    lines = Path(traffic.path).read_bytes().splitlines(keepends=True)
    Path(traffic.rotated).write_bytes(HEADER + lines[1])  # the same record in both files (a rotation)
    assert len(export(traffic.path, tmp_path / "both.jsonl")) == 3


def test_a_torn_last_line_is_ignored(log: str, tmp_path: Path, capsys: Any) -> None:
    with open(log, "ab") as stream:
        stream.write(b'{"kind": "chat", "messa')
    assert len(export(log, tmp_path / "out.jsonl")) == 4
    assert "ignored 1 torn last line" in capsys.readouterr().err


def test_a_file_that_is_not_the_nodes_log_is_refused_and_left_untouched(tmp_path: Path, capsys: Any) -> None:
    foreign = tmp_path / "notes.jsonl"
    foreign.write_bytes(b'{"role": "user", "content": "hi"}\n')
    out = tmp_path / "out.jsonl"
    assert main([str(foreign), "-o", str(out)]) == 1
    assert "not a request log" in capsys.readouterr().err
    assert foreign.read_bytes() == b'{"role": "user", "content": "hi"}\n' and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl"]  # no temporary file left


def test_the_output_is_never_the_log_and_never_replaced_unasked(log: str, tmp_path: Path, capsys: Any) -> None:
    before = Path(log).read_bytes()
    assert main([log, "-o", log]) == 1 and Path(log).read_bytes() == before
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    assert main([log, "-o", str(out)]) == 1 and out.read_text() == "keep me\n"
    assert "--force" in capsys.readouterr().err
    assert main([log, "-o", str(out), "--force"]) == 0 and out.read_text() != "keep me\n"
    assert main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.jsonl")]) == 1
