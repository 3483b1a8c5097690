"""``gemma-spec-serve`` in a process of its own, ``gemma-spec-generate`` and a ROS client against it.

The served text must equal the engine's own output for the same seeded request: the reference
Engine runs in this process with the same parameters (read from the same YAML + overrides) and sees
the same requests in the same order, so its n-gram caches, drafts and batch shapes match the node's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
from action_msgs.msg import GoalStatus
from gemma_spec_msgs.action import Generate

from gemma_spec_ros.client import GenerateClient, key_values, wait_until
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.drafters import learned_cache
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.messages import request_from_goal
from gemma_spec_ros.node.parameters import defaults, engine_config_from
from gemma_spec_ros.tools import generate
from gemma_spec_ros.tools.generate import EXIT_OK, EXIT_REJECTED, EXIT_UNAVAILABLE
from support.chat import embedded_template_file
from support.engine import collect
from support.node import bin_path, serving, yaml_parameters

NODE = "gemma_spec_serve_test"
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
# Sampled (seeded) rather than greedy, so the sampler's determinism is part of the check.
GOAL: Dict[str, Any] = dict(prompt=PROMPT, max_tokens=24, temperature=0.7, top_p=0.0, top_k=0,
                            seed=5, spec_mode="")


@pytest.fixture(scope="module")
def overrides(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """Command-line overrides of config/embedded.yaml: small context, fixed K (not adaptive, so the
    drafts do not depend on timing), a dynamic n-gram cache file in a temporary folder."""
    folder = tmp_path_factory.mktemp("serve")
    return {"target.n_ctx": 1024, "spec.adaptive": False, "spec.draft_max": 3,
            "lookup.dynamic_path": str(folder / "dynamic.bin"), "lookup.cache_dir": str(folder),
            "chat.template_path": str(embedded_template_file(folder))}


@pytest.fixture(scope="module")
def server(repo_root: Path, venv_python: Path, overrides: Dict[str, Any],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """gemma-spec-serve on config/embedded.yaml, configured and active."""
    log = tmp_path_factory.mktemp("serve_log") / "serve.log"
    with serving(repo_root, venv_python, overrides, log, node=NODE) as process:
        yield process


@dataclass
class Reference:
    """The engine with the server's parameters, its dynamic n-gram cache and suffix history in memory only."""

    engine: Engine
    values: Dict[str, Any]

    def text(self) -> str:
        """The engine's own text for GOAL (the node's goal -> request conversion included)."""
        request = request_from_goal(Generate.Goal(**GOAL), self.values)
        return collect(self.engine, request).text


@pytest.fixture(scope="module")
def reference(repo_root: Path, overrides: Dict[str, Any]) -> Iterator[Reference]:
    values = {**defaults(), **yaml_parameters(repo_root / "gemma_spec_ros" / "config" / "embedded.yaml"), **overrides,
              "lookup.dynamic_path": "", "suffix.history_path": ""}
    engine = Engine(engine_config_from(values), calibrate=False)  # fixed K: costs are not used
    yield Reference(engine, values)
    engine.close()


@pytest.fixture(scope="module")
def client(server: subprocess.Popen, ros: None) -> Iterator[GenerateClient]:
    client = GenerateClient(f"/{NODE}", name="gemma_spec_serve_test_client")
    yield client
    client.close()


@pytest.mark.timeout(400)
def test_round_trip_streams_the_engines_text(client: GenerateClient, reference: Reference) -> None:
    run = client.send(**GOAL)
    assert run.accepted
    result = run.wait_result()
    expected = reference.text()
    assert run.status == GoalStatus.STATUS_SUCCEEDED and result.finish_reason == "length"
    assert result.text == expected and result.completion_tokens == 24
    assert len(run.feedback) >= 2 and run.feedback[-1].completion_tokens == 24
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    assert result.spec_mode == "lookup" and result.stats.num_generated_tokens == 24
    stats = result.stats  # lookup really drafted on this code prompt; the counters add up
    assert stats.num_drafts > 0
    assert stats.num_generated_tokens == 1 + stats.num_steps + stats.num_accepted_tokens


@pytest.mark.timeout(120)
def test_generate_cli_prints_the_same_text(client: GenerateClient, reference: Reference,
                                           venv_python: Path, repo_root: Path) -> None:
    """Second identical request (server and reference both have learned from the first)."""
    cli = [bin_path(venv_python, "gemma-spec-generate"), GOAL["prompt"], "--stream",
           "--max-tokens", str(GOAL["max_tokens"]), "--temperature", str(GOAL["temperature"]),
           "--seed", str(GOAL["seed"]), "--node", NODE, "--timeout", "60"]
    out = subprocess.run(cli, cwd=repo_root, capture_output=True, text=True, timeout=100)
    assert out.returncode == EXIT_OK, out.stderr
    assert out.stdout == reference.text() + "\n"
    assert "status: SUCCEEDED" in out.stderr and "tau (mean acceptance length)" in out.stderr

    rejected = subprocess.run(cli + ["--spec-mode", "draft"], cwd=repo_root, capture_output=True,
                              text=True, timeout=100)
    assert rejected.returncode == EXIT_REJECTED, rejected.stderr


@pytest.mark.timeout(120)
def test_generate_cli_sends_a_json_schema_and_a_grammar_from_files(client: GenerateClient, venv_python: Path,
                                                                   repo_root: Path, tmp_path: Path) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["skill"],
              "properties": {"skill": {"enum": ["navigate", "pick", "place"]}}}
    (tmp_path / "action.schema.json").write_text(json.dumps(schema))
    (tmp_path / "answer.gbnf").write_text('root ::= " " ("yes" | "no")\n')
    base = [bin_path(venv_python, "gemma-spec-generate"), "The next action as JSON:", "--max-tokens", "48",
            "--node", NODE, "--timeout", "60"]
    out = subprocess.run(base + ["--json-schema", str(tmp_path / "action.schema.json")], cwd=repo_root,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == EXIT_OK, out.stderr
    assert json.loads(out.stdout)["skill"] in ("navigate", "pick", "place"), out.stdout
    out = subprocess.run(base + ["--grammar", str(tmp_path / "answer.gbnf")], cwd=repo_root,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == EXIT_OK and out.stdout in (" yes\n", " no\n"), (out.stdout, out.stderr)
    missing = subprocess.run(base + ["--grammar", str(tmp_path / "nothing.gbnf")], cwd=repo_root,
                             capture_output=True, text=True, timeout=100)
    assert missing.returncode == EXIT_REJECTED and "cannot read" in missing.stderr, missing.stderr


@pytest.mark.timeout(180)
def test_generate_cli_cancels_its_goal_when_it_gives_up_waiting(client: GenerateClient, venv_python: Path,
                                                                repo_root: Path) -> None:
    """L11 (first review): on --timeout the client exited and left its goal running on the node,
    holding the queue. Now it cancels the goal first.

    The node serves one goal at a time: three goals of 500 greedy tokens in plain decoding (~7.5 s
    each here, ~22 s together) hold it, so the command's goal is still waiting when its 8 s run out
    (--timeout bounds the wait for the server and then the wait for the result, each up to 8 s;
    load slows the holders too); they are cancelled after it."""
    status = spec_status_name(NODE)
    before = int(key_values(client.wait_status(status))["requests cancelled"])
    holders = [client.send(prompt=PROMPT, max_tokens=500, temperature=0.0, spec_mode="off") for _ in range(3)]
    assert all(run.accepted for run in holders)
    cli = [bin_path(venv_python, "gemma-spec-generate"), GOAL["prompt"], "--max-tokens", "450",
           "--node", NODE, "--timeout", "8"]
    out = subprocess.run(cli, cwd=repo_root, capture_output=True, text=True, timeout=60)
    for run in holders:
        client.cancel(run, timeout=15)
    held = sum(run.wait_result(timeout=60).finish_reason == "cancelled" for run in holders)
    assert out.returncode == EXIT_UNAVAILABLE and "goal cancelled" in out.stderr, out.stderr
    assert held >= 1  # the holders outlasted the command
    client.wait_status(status, lambda s: int(key_values(s)["requests cancelled"]) == before + 1 + held,
                       timeout=15)


@pytest.mark.timeout(300)
def test_generate_cli_sends_a_chat_turn_from_a_file(client: GenerateClient, venv_python: Path,
                                                    repo_root: Path, tmp_path: Path) -> None:
    """``--chat FILE.json`` (the embedded model with the agent suite's template as
    chat.template_path): the assistant's message comes back as one JSON object of OpenAI's shape,
    its call validated; appended to the file's messages with the call's result it makes the next
    turn, a text answer; a file the node would refuse is not sent, and says why."""
    from gemma_spec_dev.bench.agent_suite import SKILLS, SYSTEM

    chat = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Bring a cup from the kitchen counter to the sofa."}],
            "tools": SKILLS, "tool_choice": "required"}
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(chat))
    base = [bin_path(venv_python, "gemma-spec-generate"), "--chat", str(path), "--max-tokens", "64",
            "--node", NODE, "--timeout", "200"]
    out = subprocess.run(base + ["--spec-mode", "suffix"], cwd=repo_root, capture_output=True, text=True, timeout=240)
    assert out.returncode == EXIT_OK, out.stderr
    message = json.loads(out.stdout)
    call = message["tool_calls"][0]
    assert message["role"] == "assistant" and call["type"] == "function"
    assert call["function"]["name"] in {tool["function"]["name"] for tool in SKILLS}
    assert "finish_reason: tool_calls" in out.stderr and "status: SUCCEEDED" in out.stderr
    chat["messages"] += [message, {"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'}]
    chat["tool_choice"] = "none"
    path.write_text(json.dumps(chat))
    out = subprocess.run(base + ["--stream"], cwd=repo_root, capture_output=True, text=True, timeout=240)
    assert out.returncode == EXIT_OK, out.stderr
    answer = json.loads(out.stdout)
    assert "tool_calls" not in answer and answer["content"] and answer["content"] in out.stderr
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}))
    bad = subprocess.run(base, cwd=repo_root, capture_output=True, text=True, timeout=100)
    assert bad.returncode == EXIT_REJECTED and "not sent: unknown role 'robot'" in bad.stderr, bad.stderr


def test_generate_cli_streams_feedback_before_the_result(capsys: pytest.CaptureFixture) -> None:
    """--stream prints each feedback's text as it arrives, then only what the result adds; without
    it nothing is printed before the result. (The CLI's stdout above is the same either way.)"""
    def feedback(text: str) -> Any:
        return Generate.Impl.FeedbackMessage(feedback=Generate.Feedback(text=text))

    printer = generate._Printer(stream=True)
    printer.feedback(feedback("Hello"))
    assert capsys.readouterr().out == "Hello"
    printer.feedback(feedback(", wor"))
    assert capsys.readouterr().out == ", wor"
    printer.result("Hello, world")
    assert capsys.readouterr().out == "ld\n"
    quiet = generate._Printer(stream=False)
    quiet.feedback(feedback("Hello"))
    assert capsys.readouterr().out == ""
    quiet.result("Hello, world")
    assert capsys.readouterr().out == "Hello, world\n"


@pytest.mark.timeout(400)
def test_sigterm_shuts_down_cleanly_and_saves_the_dynamic_cache(
        client: GenerateClient, repo_root: Path, venv_python: Path, overrides: Dict[str, Any],
        tmp_path: Path) -> None:
    """A server of its own (the module's keeps serving the other tests): one request, SIGTERM,
    exit 0, and the dynamic cache file holds that request's n-grams."""
    name = "gemma_spec_serve_sigterm"
    dynamic = tmp_path / "dynamic.bin"
    with serving(repo_root, venv_python, {**overrides, "lookup.dynamic_path": str(dynamic), "lookup.cache_dir": str(tmp_path)},
                 tmp_path / "serve.log", node=name) as process:
        own = GenerateClient(f"/{name}", name="gemma_spec_serve_sigterm_client")
        try:
            result = own.send(**GOAL).wait_result()
        finally:
            own.close()
        assert result.finish_reason == "length"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=45) == 0, process.log.read_text()  # type: ignore[attr-defined]
        saved = f"dynamic n-gram cache saved to {dynamic}"
        assert saved in process.log.read_text()  # type: ignore[attr-defined]
    _, cache = learned_cache.read(dynamic)
    assert len(cache) > 0 and cache.total_count >= result.prompt_tokens + result.completion_tokens - 4


@pytest.mark.timeout(60)
def test_gemma_spec_node_waits_unconfigured_and_stops_on_sigint(client: GenerateClient, venv_python: Path,
                                                                 repo_root: Path) -> None:
    """``gemma_spec_node`` as the launch file runs it: the lifecycle is driven from outside."""
    name = "gemma_spec_no_autostart"
    process = subprocess.Popen(
        [bin_path(venv_python, "gemma_spec_node"), "--ros-args", "-r", f"__node:={name}",
         "--params-file", "gemma_spec_ros/config/embedded.yaml"], cwd=repo_root,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    other = GenerateClient(f"/{name}", name="gemma_spec_no_autostart_client")
    try:
        assert other.state() == "unconfigured"
    finally:
        other.close()
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=30)[0]
    assert process.returncode == 0, output


@pytest.mark.timeout(60)
def test_serve_exits_nonzero_naming_the_missing_model(venv_python: Path, repo_root: Path) -> None:
    missing = "/nonexistent/gemma_spec_test/missing.gguf"
    out = subprocess.run(
        [bin_path(venv_python, "gemma-spec-serve"), "--params-file", "gemma_spec_ros/config/embedded.yaml",
         "--node-name", "gemma_spec_serve_fail", "--ros-args", "-p", f"target.model_path:={missing}"],
        cwd=repo_root, capture_output=True, text=True, timeout=50,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "configure failed" in out.stderr and missing in out.stderr
