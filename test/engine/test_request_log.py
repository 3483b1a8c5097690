"""The request log (engine/request_log.py) without ROS: what a record holds and which requests get
one, the size bound (the newest records kept), crash safety (a torn last line ignored on read and
trimmed at the next open), the file rules of the learned cache (only the log's own file is appended
to, rotated or trimmed; anything else at its path or its rotated path is refused and left untouched;
the path lies in lookup.cache_dir), and a failed write that is a fault, never an exception."""
from __future__ import annotations

import doctest
import json
import os
import threading
from pathlib import Path
from typing import Any, Dict

import pytest

from gemma_spec_ros.engine import request_log
from gemma_spec_ros.engine.chat import AssistantReply, ChatMessage, Conversation, ToolCall, parse_tools
from gemma_spec_ros.engine.config import SamplingParams
from gemma_spec_ros.engine.request import GenerationRequest, Step
from gemma_spec_ros.engine.request_log import (HEADER, ForeignLogError, ReadCounts, RecordTooLargeError,
                                               TrafficLog, entry_of, files_of, open_log, read_records)
from gemma_spec_ros.engine.stats import SpecStats

TOOLS = parse_tools(json.dumps([{"type": "function", "function": {
    "name": "move_to", "description": "Drive to a place.",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}}}]))


def step(finish_reason: str, reply: Any = None, mode: str = "lookup") -> Step:
    stats = SpecStats(num_prompt_tokens=7, num_generated_tokens=5)
    return Step(tokens=(1,), text="", stats=stats, spec_mode=mode, draft_max=4, finish_reason=finish_reason,
                reply=reply)


def plain_request(prompt: str = "Where is the cup?", **fields: Any) -> GenerationRequest:
    return GenerationRequest(prompt, max_tokens=16, sampling=SamplingParams(temperature=0.0), **fields)


def chat_request() -> GenerationRequest:
    conversation = Conversation((ChatMessage("system", "You plan."), ChatMessage("user", "Go to the dock.")),
                                TOOLS, "auto")
    return GenerationRequest(conversation=conversation, max_tokens=64)


def entry(n: int, size: int = 40) -> Dict[str, Any]:
    return {"kind": "generate", "n": n, "prompt": "p" * size, "system_prompt": "", "use_chat_template": True,
            "text": "t", "finish_reason": "stop"}


def total_bytes(log: TrafficLog) -> int:
    return sum(os.path.getsize(f) for f in files_of(log.path))


def test_doctests() -> None:
    assert doctest.testmod(request_log).failed == 0


def test_no_path_is_no_log(tmp_path: Path) -> None:
    assert open_log("", 1 << 20, str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []


def test_a_finished_prompt_is_recorded_with_its_fields() -> None:
    request = plain_request(system_prompt="Be brief.", use_chat_template=True, json_schema='{"type": "object"}')
    record = entry_of(request, '{"a": 1}', "stop", step("stop"), target="t.gguf", time="T")
    assert len(record.pop("id")) == 16
    assert record == {"kind": "generate", "time": "T", "target": "t.gguf", "finish_reason": "stop",
                      "spec_mode": "lookup", "temperature": 0.0, "max_tokens": 16, "constrained": True,
                      "prompt_tokens": 7, "completion_tokens": 5, "prompt": "Where is the cup?",
                      "system_prompt": "Be brief.", "use_chat_template": True, "text": '{"a": 1}'}


def test_a_chat_turn_is_recorded_in_openais_shapes_and_its_calls_finish_as_tool_calls() -> None:
    call = ToolCall("call_1", "move_to", '{"place": "dock"}')
    reply = AssistantReply("On my way.", (call,))
    record = entry_of(chat_request(), "On my way.", "stop", step("stop", reply), time="T")
    assert record["kind"] == "chat" and record["finish_reason"] == "tool_calls"
    assert record["messages"] == [{"role": "system", "content": "You plan."},
                                  {"role": "user", "content": "Go to the dock."}]
    assert record["tools"] == [TOOLS[0].as_openai()] and record["tool_choice"] == "auto"
    assert record["message"] == {"role": "assistant", "content": "On my way.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "move_to", "arguments": '{"place": "dock"}'}}]}
    assert "reply_error" not in record
    left_out = entry_of(chat_request(), "", "stop", step("stop", AssistantReply("", (), "a call does not parse")))
    assert left_out["reply_error"] == "a call does not parse" and left_out["finish_reason"] == "stop"


@pytest.mark.parametrize("finish_reason", ["cancelled", "preempted", "timeout", "error"])
def test_a_request_that_did_not_finish_is_not_recorded(finish_reason: str) -> None:
    assert entry_of(plain_request(), "half", finish_reason, step(finish_reason)) is None
    assert entry_of(chat_request(), "half", finish_reason, step(finish_reason, AssistantReply("half"))) is None
    assert entry_of(plain_request(), "", "stop", None) is None  # no step: the engine made none


def test_records_are_appended_after_the_header_and_read_back_in_order(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 1 << 20, str(tmp_path), target="t")
    for reason in ("stop", "length", "cancelled"):
        assert log.record(plain_request(reason), "text", reason, step(reason)) == ""
    data = (tmp_path / "traffic.jsonl").read_bytes()
    assert data.startswith(HEADER) and data.count(b"\n") == 3
    assert [r["prompt"] for r in read_records(log.path)] == ["stop", "length"]
    assert oct((tmp_path / "traffic.jsonl").stat().st_mode & 0o777) == "0o600"


def test_the_bound_holds_and_the_newest_records_are_kept(tmp_path: Path) -> None:
    max_bytes = 8192
    log = open_log("traffic.jsonl", max_bytes, str(tmp_path))
    for n in range(600):
        log.append(entry(n, size=20 + (n * 37) % 200))
        assert total_bytes(log) <= max_bytes
        assert all(os.path.getsize(f) <= max_bytes // 2 for f in files_of(log.path))
    kept = [r["n"] for r in read_records(log.path)]
    assert kept == list(range(kept[0], 600)), "a contiguous run of the newest records"
    assert len(kept) >= 20 and os.path.exists(log.rotated)


def test_a_record_larger_than_half_the_bound_is_a_fault(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 8192, str(tmp_path))
    with pytest.raises(RecordTooLargeError):
        log.append(entry(0, size=5000))
    fault = log.record(plain_request("x" * 5000), "t", "stop", step("stop"))
    assert "not recorded" in fault and "traffic.max_bytes" in fault and log.unwritten == 1


def test_a_torn_last_line_is_ignored_on_read_and_trimmed_at_the_next_open(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    for n in range(3):
        log.append(entry(n))
    with open(log.path, "ab") as stream:  # a crash in the middle of a write
        stream.write(b'{"kind": "generate", "n": 3, "pro')
    counts = ReadCounts()
    assert [r["n"] for r in read_records(log.path, counts)] == [0, 1, 2] and counts.torn == 1
    again = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    assert (tmp_path / "traffic.jsonl").read_bytes().endswith(b"\n")
    again.append(entry(4))
    counts = ReadCounts()
    assert [r["n"] for r in read_records(log.path, counts)] == [0, 1, 2, 4] and counts.torn == 0


def test_a_torn_line_left_by_the_running_node_is_trimmed_by_its_next_append(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    log.append(entry(0))
    with open(log.path, "ab") as stream:
        stream.write(b'{"kind": "gen')
    log.append(entry(1))
    assert [r["n"] for r in read_records(log.path)] == [0, 1]


def test_a_line_that_is_no_record_is_skipped(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    log.append(entry(0))
    with open(log.path, "ab") as stream:
        stream.write(b'not json\n[1, 2]\n{"kind": "other"}\n')
    log.append(entry(1))
    counts = ReadCounts()
    assert [r["n"] for r in read_records(log.path, counts)] == [0, 1] and counts.damaged == 3


def test_a_lower_bound_at_the_next_open_keeps_the_newest_records(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    for n in range(400):
        log.append(entry(n))
    smaller = open_log("traffic.jsonl", 8192, str(tmp_path))
    assert total_bytes(smaller) <= 4096  # one file, within its half
    kept = [r["n"] for r in read_records(smaller.path)]
    assert kept[-1] == 399 and kept == list(range(kept[0], 400))


FOREIGN = {
    "a key file": b"-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n",
    "an empty file": b"",
    "a JSON Lines file of someone else": b'{"format": "other"}\n{"kind": "generate"}\n',
    "another version of the log": b'{"format": "gemma_spec_ros.traffic", "version": 99}\n',
}


@pytest.mark.parametrize("rotated", [False, True], ids=["at the path", "at the rotated path"])
@pytest.mark.parametrize("what", sorted(FOREIGN))
def test_a_foreign_file_is_refused_and_left_untouched(tmp_path: Path, what: str, rotated: bool) -> None:
    foreign = tmp_path / ("traffic.jsonl.1" if rotated else "traffic.jsonl")
    foreign.write_bytes(FOREIGN[what])
    before = foreign.stat()
    with pytest.raises(ForeignLogError, match="left untouched"):
        open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    assert foreign.read_bytes() == FOREIGN[what] and foreign.stat().st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == [foreign.name]
    with pytest.raises(ForeignLogError):
        list(read_records(str(tmp_path / "traffic.jsonl")))


@pytest.mark.timeout(30)
def test_a_fifo_or_a_folder_at_the_path_is_refused_without_a_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "traffic.jsonl")
    with pytest.raises(ForeignLogError):
        open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(ForeignLogError):
        open_log("folder.jsonl", 1 << 20, str(tmp_path))


def test_a_rotation_never_replaces_a_foreign_rotated_file(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 8192, str(tmp_path))
    log.append(entry(0))
    Path(log.rotated).write_bytes(b"someone's file\n")  # appeared while the node ran
    for n in range(1, 200):
        if log.record(plain_request(f"{n:04d}" + "p" * 100), "t", "stop", step("stop")):
            break
    else:
        pytest.fail("the log rotated over a foreign file")
    assert Path(log.rotated).read_bytes() == b"someone's file\n"
    assert os.path.getsize(log.path) <= 4096


def test_a_write_failure_is_a_fault_reported_once_until_a_record_is_written(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 1 << 20, str(tmp_path))
    assert log.record(plain_request("one"), "t", "stop", step("stop")) == ""
    os.replace(tmp_path / "traffic.jsonl", tmp_path / "kept.jsonl")
    (tmp_path / "traffic.jsonl").write_bytes(b"a file put there by someone else\n")
    fault = log.record(plain_request("two"), "t", "stop", step("stop"))
    assert "not recorded" in fault and "no longer the request log" in fault
    assert log.record(plain_request("three"), "t", "stop", step("stop")) == ""  # the same failure: once
    assert log.unwritten == 2
    assert (tmp_path / "traffic.jsonl").read_bytes() == b"a file put there by someone else\n"
    (tmp_path / "traffic.jsonl").unlink()
    assert log.record(plain_request("four"), "t", "stop", step("stop")) == ""  # a new log starts
    assert [r["prompt"] for r in read_records(log.path)] == ["four"]
    os.replace(tmp_path / "kept.jsonl", tmp_path / "traffic.jsonl")  # the failure again: reported again
    (tmp_path / "traffic.jsonl").write_bytes(b"x")
    assert log.record(plain_request("five"), "t", "stop", step("stop")) != ""


def test_appends_from_several_threads_stay_whole_lines(tmp_path: Path) -> None:
    log = open_log("traffic.jsonl", 64 << 10, str(tmp_path))

    def write(worker: int) -> None:
        for n in range(100):
            log.append({**entry(n), "worker": worker})
    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts = ReadCounts()
    records = list(read_records(log.path, counts))
    assert counts.damaged == counts.torn == 0 and total_bytes(log) <= 64 << 10
    for worker in range(4):  # each worker's records in its order, none lost in between
        mine = [r["n"] for r in records if r["worker"] == worker]
        assert mine == list(range(mine[0], 100)) if mine else True
    assert records and any(r["n"] == 99 for r in records)


def test_the_path_lies_in_the_cache_folder(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    log = open_log("logs/traffic.jsonl", 1 << 20, str(cache))  # folders made inside it, 0700
    assert log.path == str(cache / "logs" / "traffic.jsonl")
    assert oct((cache / "logs").stat().st_mode & 0o777) == "0o700"
    assert open_log(str(cache / "t.jsonl"), 1 << 20, str(cache)).path == str(cache / "t.jsonl")
    for outside in (str(tmp_path / "t.jsonl"), "../t.jsonl"):
        with pytest.raises(ValueError, match="outside lookup.cache_dir"):
            open_log(outside, 1 << 20, str(cache))
    with pytest.raises(ValueError, match="relative to lookup.cache_dir"):
        open_log("t.jsonl", 1 << 20, "")
    with pytest.raises(ValueError, match="a file of its own"):
        open_log("learned.bin", 1 << 20, str(cache), others=(str(cache / "learned.bin"),))
    with pytest.raises(request_log.TrafficLogError, match="does not exist"):
        open_log(str(tmp_path / "missing" / "t.jsonl"), 1 << 20, "")
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "missing").exists()
