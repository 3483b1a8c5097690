"""The request log on a served node (real rclpy over loopback, the embedded Gemma 3 270M with the
agent suite's chat template, calls as JSON in <tool_call> tags): with ``traffic.log_path`` set, the
Generate and GenerateChat goals that finished are recorded with the target's replies (a refused goal
and one that ran out of time are not), ``gemma-spec-export-traffic`` turns the log into a dataset
SpecForge's and ShareGPT's readers take, and a file at the log's path that the node did not write
fails configure with the reason, before any model loads, and is left untouched."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import wait_until
from gemma_spec_ros.engine.request_log import HEADER, ReadCounts, read_records
from gemma_spec_ros.node.parameters import defaults
from gemma_spec_ros.tools.export_traffic import main as export_main
from support.chat import SKILLS_JSON, embedded_template_file
from support.node import ServedNode
from support.trainer_readers import sharegpt_reader_accepts, specforge_reader_accepts

NODE = "gemma_spec_traffic_log"
LOG = "traffic.jsonl"
SYSTEM = {"role": "system", "content": "You are the task planner of a mobile robot."}
ASK = {"role": "user", "content": "Go to the kitchen."}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traffic_log")


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], folder: Path, embedded_model_path: Path) -> ServedNode:
    overrides = {"target.model_path": str(embedded_model_path), "target.n_ctx": 1024, "spec.mode": "lookup",
                 "lookup.cache_dir": str(folder), "chat.template_path": str(embedded_template_file(folder)),
                 "limits.max_prompt_bytes": 4096, "generation.max_tokens": 8, "diagnostics.period": 0.2,
                 "traffic.log_path": LOG, "traffic.max_bytes": 1 << 20}
    return node_client(NODE, {k: v for k, v in overrides.items() if v != defaults()[k]})


@pytest.fixture(scope="module")
def results(served: ServedNode) -> Dict[str, Any]:
    """The node's answers to a few goals of either action, and a refused and a timed-out one."""
    client = served.client
    out: Dict[str, Any] = {}
    for name, fields in (("plain", {"prompt": "The robot drove to the", "max_tokens": 8}),
                         ("system", {"prompt": "List three colors:", "system_prompt": "Be brief.",
                                     "max_tokens": 6})):
        run = client.send(temperature=0.0, **fields)
        assert run.accepted
        out[name] = run.wait_result()
    refused = client.send(prompt="x" * 5000, max_tokens=4)  # over limits.max_prompt_bytes
    assert not refused.accepted
    late = client.send(prompt="Too late.", max_tokens=4, time_budget=0.001)
    out["late"] = late.wait_result() if late.accepted else None
    for name, fields in (("text", {"tool_choice": "none", "max_tokens": 8}),
                         ("call", {"tool_choice": "move_to", "max_tokens": 64})):
        run = client.send_chat(messages=[SYSTEM, ASK], tools=SKILLS_JSON, temperature=0.0, **fields)
        assert run.accepted
        out[name] = run.wait_result()
        assert run.status == GoalStatus.STATUS_SUCCEEDED
    wait_until(lambda: not served.node._goals.busy(), 60, "an idle queue")
    return out


def records_of(folder: Path) -> List[Dict[str, Any]]:
    counts = ReadCounts()
    records = list(read_records(str(folder / LOG), counts))
    assert counts.torn == counts.damaged == 0
    return records


@pytest.mark.timeout(600)
def test_the_log_holds_the_finished_goals_and_the_targets_replies(results: Dict[str, Any], folder: Path) -> None:
    assert results["late"] is None or results["late"].finish_reason == "timeout"
    records = records_of(folder)
    assert [r["kind"] for r in records] == ["generate", "generate", "chat", "chat"]
    plain, system, text, call = records
    for record, result in ((plain, results["plain"]), (system, results["system"])):
        assert record["text"] == result.text and record["finish_reason"] == result.finish_reason
        assert record["spec_mode"] == result.spec_mode and record["completion_tokens"] == result.completion_tokens
        assert record["use_chat_template"] is False and record["temperature"] == 0.0
        assert "gemma-3-270m" in record["target"]
    assert plain["prompt"] == "The robot drove to the" and plain["system_prompt"] == ""
    assert system["prompt"] == "List three colors:" and system["system_prompt"] == "Be brief."
    assert all("x" * 100 not in json.dumps(r) and r["prompt"] != "Too late." for r in records if "prompt" in r)
    for record, result in ((text, results["text"]), (call, results["call"])):
        assert record["messages"] == [SYSTEM, ASK] and record["tools"] == json.loads(SKILLS_JSON)
        assert record["finish_reason"] == result.finish_reason
        assert record["message"]["content"] == result.message.content
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in result.message.tool_calls]
        assert record["message"].get("tool_calls", []) == calls
    assert text["tool_choice"] == "none" and "tool_calls" not in text["message"]
    assert call["tool_choice"] == "move_to"
    if results["call"].finish_reason == "tool_calls":  # the grammar holds a 270M model to the call
        assert call["message"]["tool_calls"][0]["function"]["name"] == "move_to"
    assert oct((folder / LOG).stat().st_mode & 0o777) == "0o600"


@pytest.mark.timeout(600)
def test_the_exported_datasets_are_what_the_trainers_read(results: Dict[str, Any], folder: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "specforge.jsonl"
    assert export_main([str(folder / LOG), "-o", str(out)]) == 0
    rows = [specforge_reader_accepts(line) for line in out.read_text(encoding="utf-8").splitlines()]
    replies = [results[name] for name in ("plain", "system")]
    expected = [r.text for r in replies if r.text.strip()]
    expected += [r.message.content for r in (results["text"], results["call"])
                 if r.message.content.strip() or r.message.tool_calls]
    assert [row["conversations"][-1]["content"] for row in rows] == expected
    shared = tmp_path / "sharegpt.jsonl"
    assert export_main([str(folder / LOG), "-o", str(shared), "--format", "sharegpt"]) == 0
    for line in shared.read_text(encoding="utf-8").splitlines():
        sharegpt_reader_accepts(line)


@pytest.mark.timeout(300)
def test_a_foreign_file_at_the_log_path_fails_configure_and_is_left_untouched(
        node_client: Callable[..., ServedNode], embedded_model_path: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "notes.jsonl"
    foreign.write_bytes(b'{"my": "notes"}\n')
    before = foreign.stat().st_mtime_ns
    served = node_client(f"{NODE}_foreign", {"target.model_path": str(embedded_model_path),
                                             "lookup.cache_dir": str(tmp_path),
                                             "traffic.log_path": "notes.jsonl"}, activate=False)
    assert not served.client.transition("configure")
    assert "cannot keep the request log" in served.node.configure_error
    assert "not a request log written by gemma_spec_ros" in served.node.configure_error
    assert served.node._engine is None  # refused before any model loaded
    assert foreign.read_bytes() == b'{"my": "notes"}\n' and foreign.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl"]
    foreign.unlink()  # the path freed: the node configures and starts its own log
    assert served.client.transition("configure"), served.node.configure_error
    assert (tmp_path / "notes.jsonl").read_bytes() == HEADER
