"""The ROS path as a robotics engineer walks it: the real `ros2 launch` and `ros2` CLI in subprocesses.

`ros2 launch gemma_spec_ros orin.launch.py params_file:=...` (the package form of the README) brings
the node up on the embedded model; `ros2 lifecycle`, `ros2 param`, `ros2 action send_goal --feedback`,
`ros2 topic echo` and `ros2 run` drive it as a user does; SIGINT to the launch's process group (a
terminal's Ctrl-C) ends it. Nothing here talks to the node through Python APIs: every check reads what
the tools print.

The tools (launch, launch_ros, ros2cli: Jazzy, from source) are not on any package registry; CI
installs them with ``../shared/ros2-tools/install.sh .venv``. Without them this module skips, saying so.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import jsonschema
import pytest
import yaml

from gemma_spec_ros.engine.drafters import learned_cache
from support.chat import embedded_template_file
from support.ros2_cli import (NODE, VENV, Background, launch, params_file, ros2, send_accepted_goal, send_chat_goal,
                              send_goal, wait_state)


@pytest.fixture(scope="module", autouse=True)
def ros2_daemon() -> Iterator[None]:
    """The CLI starts a daemon at its first call and leaves it running: stop it afterwards."""
    yield
    ros2("daemon", "stop", check=False, timeout=30)


@pytest.fixture
def own_domain(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ROS domain of this test alone: a node of its own launch must not meet the module's
    ``served`` node, which has the same name (the launch's configure request would reach both)."""
    monkeypatch.setenv("ROS_DOMAIN_ID", str(1 + (int(os.environ["ROS_DOMAIN_ID"]) + 50) % 100))
    yield
    ros2("daemon", "stop", check=False, timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, embedded_model_path: Path) -> Iterator[Path]:
    """`ros2 launch gemma_spec_ros orin.launch.py params_file:=<embedded config>`, active; its tmp dir.
    The embedded base model has no chat template: chat.template_path gives it the agent suite's."""
    tmp = tmp_path_factory.mktemp("launch")
    proc = launch(tmp, params_file(tmp, embedded_model_path, **{
        "chat.template_path": str(embedded_template_file(tmp)), "target.n_ctx": 1024}))
    try:
        wait_state("active")
        yield tmp
    finally:
        proc.interrupt()


@pytest.mark.timeout(300)
def test_launch_by_package_name_reaches_active(served: Path) -> None:
    """The README's package form finds the launch file (share/, no directory symlink) and the node
    executable (lib/gemma_spec_ros), configures and activates the node."""
    assert ros2("lifecycle", "get", NODE).startswith("active")
    log = (served / "launch.log").read_text()
    assert "configured in" in log and "active: accepting goals" in log, log


@pytest.mark.timeout(300)
def test_send_goal_streams_feedback_and_succeeds(served: Path) -> None:
    goal = send_goal(served, 24)
    goal.proc.wait(120)
    out = goal.output
    goal.close()
    assert "Goal accepted" in out, out
    assert out.count("Feedback:") >= 2, out  # one message per speculative step
    assert "Goal finished with status: SUCCEEDED" in out, out
    assert "finish_reason: length" in out and "completion_tokens: 24" in out, out


#: A one-action plan (bounded: it always completes within the goal's max_tokens)
ACTION_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["skill", "place"],
                 "properties": {"skill": {"enum": ["navigate", "pick", "place"]},
                                "place": {"enum": ["kitchen_table", "sink", "dock"]}}}


def printed_result(out: str) -> dict:
    """The Result block `ros2 action send_goal` prints (YAML; only its first line is indented), as a
    dict."""
    block = out.split("Result:", 1)[1].split("Goal finished with status", 1)[0]
    return yaml.safe_load(block.strip())


@pytest.mark.timeout(300)
def test_send_goal_with_a_json_schema_returns_json_that_validates(served: Path) -> None:
    """A planner's goal from the command line: the json_schema field, the text parses and follows
    it, and forced text was drafted by the grammar; a schema that cannot be converted is rejected."""
    goal = send_goal(served, 64, name="schema", json_schema=json.dumps(ACTION_SCHEMA),
                     prompt="The robot's next action as JSON:", spec_mode="lookup")
    goal.proc.wait(120)
    out = goal.output
    goal.close()
    assert "Goal finished with status: SUCCEEDED" in out, out
    result = printed_result(out)
    assert result["finish_reason"] == "stop", result
    jsonschema.validate(json.loads(result["text"]), ACTION_SCHEMA)
    assert result["stats"]["num_grammar_accepted_tokens"] > 0, result["stats"]
    refused = send_goal(served, 8, name="bad_schema", json_schema='{"not": {}}')
    refused.proc.wait(60)
    out = refused.output
    refused.close()
    assert "Goal was rejected" in out, out


@pytest.mark.timeout(300)
def test_send_goal_generate_chat_returns_a_typed_tool_call(served: Path) -> None:
    """A chat turn from the command line: GenerateChat with the agent suite's skills as tools and
    tool_choice required; the result's message carries one call whose arguments follow the
    skill's schema, finish_reason tool_calls, SUCCEEDED. A turn with an unknown role is rejected."""
    from gemma_spec_dev.bench.agent_suite import SKILLS
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in SKILLS}
    goal = {"messages": [{"role": "user", "content": "Put the apple from the kitchen table into the fridge."}],
            "tools": json.dumps(SKILLS), "tool_choice": "required", "max_tokens": 64, "temperature": 0.0,
            "spec_mode": "suffix"}
    sent = send_chat_goal(served, goal)
    sent.proc.wait(200)
    out = sent.output
    sent.close()
    assert "Goal accepted" in out and "Goal finished with status: SUCCEEDED" in out, out
    result = printed_result(out)
    assert result["finish_reason"] == "tool_calls" and result["error"] == "", result
    (call,) = result["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    bad = send_chat_goal(served, {**goal, "messages": [{"role": "robot", "content": "hi"}]}, name="bad_chat")
    bad.proc.wait(60)
    out = bad.output
    bad.close()
    assert "Goal was rejected" in out, out


@pytest.mark.timeout(300)
def test_cancel_from_the_cli_ends_the_goal_canceled(served: Path) -> None:
    """A goal sent with `ros2 action send_goal` and cancelled with `ros2 service call` of the
    action's cancel service ends CANCELED; the sending CLI prints that status.

    (Ctrl-C of `ros2 action send_goal` is no way to cancel on Jazzy: rclpy's SIGINT handler shuts
    its context down before the CLI's own cancel is sent, it prints "Exception while canceling goal:
    None", and the goal runs on.)"""
    goal = send_accepted_goal(served, 400, name="cancelled")
    try:
        goal_id = goal.wait_for("Feedback:").split("Goal accepted with ID: ")[1].split()[0]
        uuid = list(bytes.fromhex(goal_id))
        answer = ros2("service", "call", f"{NODE}/generate/_action/cancel_goal",
                      "action_msgs/srv/CancelGoal", f"{{goal_info: {{goal_id: {{uuid: {uuid}}}}}}}")
        assert "return_code=0" in answer and str(uuid[:4])[1:-1] in " ".join(answer.split()), answer
        goal.proc.wait(60)
        out = goal.output
    finally:
        goal.close()
    assert "Goal finished with status: CANCELED" in out, out
    assert "finish_reason: cancelled" in out, out


@pytest.mark.timeout(300)
def test_param_set_modes_k_and_refusals(served: Path) -> None:
    """`ros2 param set` of spec.mode (off unquoted: YAML's boolean), lookup, auto and K; invalid
    values are refused with the node's reason printed; describe shows the range."""
    try:
        assert "Set parameter successful" in ros2("param", "set", NODE, "spec.mode", "off")
        assert "False" in ros2("param", "get", NODE, "spec.mode")
        for mode in ("lookup", "auto"):
            assert "Set parameter successful" in ros2("param", "set", NODE, "spec.mode", mode)
            assert mode in ros2("param", "get", NODE, "spec.mode")
        assert "Set parameter successful" in ros2("param", "set", NODE, "spec.draft_max", "2")
        refused = ros2("param", "set", NODE, "spec.mode", "bogus", check=False)
        assert "Setting parameter failed" in refused and "expected one of" in refused, refused
        refused = ros2("param", "set", NODE, "spec.mode", "true", check=False)
        assert "Setting parameter failed" in refused and "boolean" in refused, refused
        refused = ros2("param", "set", NODE, "spec.mode", "draft", check=False)
        assert "Setting parameter failed" in refused and "draft model" in refused, refused
        refused = ros2("param", "set", NODE, "spec.draft_max", "100", check=False)
        assert "Setting parameter failed" in refused, refused
        refused = ros2("param", "set", NODE, "target.n_ctx", "1024", check=False)
        assert "Setting parameter failed" in refused and "unconfigured" in refused, refused
        described = ros2("param", "describe", NODE, "spec.draft_max")
        assert "Min value: 1" in described and "Max value: 64" in described, described
        assert "Type: integer" in described, described
        assert "2" in ros2("param", "get", NODE, "spec.draft_max")
    finally:
        ros2("param", "set", NODE, "spec.mode", "lookup", check=False)
        ros2("param", "set", NODE, "spec.draft_max", "3", check=False)


@pytest.mark.timeout(300)
def test_lifecycle_set_deactivate_and_activate(served: Path) -> None:
    try:
        assert "Transitioning successful" in ros2("lifecycle", "set", NODE, "deactivate")
        assert ros2("lifecycle", "get", NODE).startswith("inactive")
        refused = send_goal(served, 8, name="refused")
        refused.proc.wait(120)
        assert "Goal was rejected" in refused.output, refused.output
        refused.close()
    finally:
        assert "Transitioning successful" in ros2("lifecycle", "set", NODE, "activate")
    assert ros2("lifecycle", "get", NODE).startswith("active")


@pytest.mark.timeout(300)
def test_topic_echo_diagnostics_and_spec_stats_carry_tau(served: Path) -> None:
    """After a goal, `/gemma_spec/spec_stats` and `/diagnostics` (echoed once) carry τ."""
    stats = Background([str(VENV / "bin" / "ros2"), "topic", "echo", "--once",
                        f"{NODE}/spec_stats", "gemma_spec_msgs/msg/SpecStats"], served / "stats.log")
    try:
        time.sleep(3.0)  # let the echo subscription match the node's publisher
        goal = send_goal(served, 48, name="stats_goal")
        goal.proc.wait(120)
        goal.close()
        stats.proc.wait(60)
        echoed = yaml.safe_load(stats.output.split("---")[0])
    finally:
        stats.close()
    assert echoed["num_drafts"] > 0 and echoed["mean_acceptance_length"] > 1.0, echoed
    assert echoed["num_generated_tokens"] == 48, echoed
    diagnostics = ros2("topic", "echo", "--once", "/diagnostics", "diagnostic_msgs/msg/DiagnosticArray",
                       timeout=60)
    assert "gemma_spec: speculative decoding" in diagnostics, diagnostics
    assert "key: tau (mean acceptance length)" in diagnostics, diagnostics
    tau_line = diagnostics.split("key: tau (mean acceptance length)")[1].splitlines()[1]
    assert float(tau_line.split("value:")[1].strip().strip("'")) > 1.0, tau_line


@pytest.mark.timeout(300)
def test_ros2_run_with_spec_mode_off_on_the_command_line(
        tmp_path: Path, embedded_model_path: Path, own_domain: None) -> None:
    """`ros2 run gemma_spec_ros gemma_spec_node --ros-args -p spec.mode:=off` (the executable in
    lib/gemma_spec_ros; `off` arrives as YAML's boolean) waits unconfigured, then configures."""
    assert "gemma_spec_ros gemma_spec_node" in ros2("pkg", "executables", "gemma_spec_ros")
    node = Background([str(VENV / "bin" / "ros2"), "run", "gemma_spec_ros", "gemma_spec_node",
                       "--ros-args", "-p", "spec.mode:=off", "-p", f"target.model_path:={embedded_model_path}",
                       "-p", "target.n_ctx:=512", "-p", f"lookup.dynamic_path:={tmp_path / 'dynamic.bin'}", "-p", f"lookup.cache_dir:={tmp_path}"],
                      tmp_path / "run.log")
    try:
        wait_state("unconfigured", timeout=60)
        assert "Boolean value is: False" in ros2("param", "get", NODE, "spec.mode")
        assert "Transitioning successful" in ros2("lifecycle", "set", NODE, "configure", timeout=120)
        assert "spec.mode=off" in node.wait_for("configured in"), node.output
    finally:
        status = node.interrupt()
    assert status == 0, node.output


@pytest.mark.timeout(420)
def test_missing_model_fails_configure_with_the_reason_then_is_fixed(
        tmp_path: Path, embedded_model_path: Path, own_domain: None) -> None:
    """A missing model: configure fails, the reason is printed, nothing hangs, the node stays
    unconfigured and running (README: fix the path, then configure and activate).
    ``spec.mode: off`` is written unquoted in the parameter file (YAML's boolean)."""
    missing = tmp_path / "no-such-model.gguf"
    params = params_file(tmp_path, missing)
    params.write_text(params.read_text().replace("mode: lookup", "mode: off"))
    assert "mode: off" in params.read_text()
    proc = launch(tmp_path, params)
    try:
        proc.wait_for(f"model file not found: {missing}", timeout=120)
        assert "configure failed" in proc.output
        wait_state("unconfigured", timeout=30)
        assert proc.proc.poll() is None, "the node must keep running, unconfigured"
        assert "Set parameter successful" in ros2("param", "set", NODE, "target.model_path",
                                                   str(embedded_model_path))
        assert "Transitioning successful" in ros2("lifecycle", "set", NODE, "configure", timeout=120)
        assert "Transitioning successful" in ros2("lifecycle", "set", NODE, "activate")
        wait_state("active", timeout=60)
        goal = send_goal(tmp_path, 8, name="fixed")
        goal.proc.wait(120)
        out = goal.output
        goal.close()
        assert "Goal finished with status: SUCCEEDED" in out and "spec_mode: 'off'" in out, out
    finally:
        status = proc.interrupt()
    assert status == 0, proc.output


@pytest.mark.timeout(420)
def test_sigint_to_the_launch_ends_the_goal_saves_the_cache_and_exits_0(
        tmp_path: Path, embedded_model_path: Path, own_domain: None) -> None:
    """Ctrl-C (SIGINT to the launch's process group) while a goal runs: the goal gets a result,
    the dynamic n-gram cache is saved with the request's n-grams, every process exits 0.
    ``spec_mode:=off`` at launch (YAML's boolean again) is taken as off."""
    params = params_file(tmp_path, embedded_model_path)
    proc = launch(tmp_path, params, "spec_mode:=off")
    goal: Optional[Background] = None
    try:
        wait_state("active")
        goal = send_accepted_goal(tmp_path, 400, name="running")
        goal.wait_for("Feedback:")
        assert "spec_mode: 'off'" in goal.output, goal.output
    finally:
        status = proc.interrupt()
    assert goal is not None
    goal.proc.wait(60)
    out = goal.output
    goal.close()
    assert status == 0, proc.output
    assert "process has finished cleanly" in proc.output, proc.output
    assert "Goal finished with status: ABORTED" in out and "finish_reason: cancelled" in out, out
    assert "shutting down" in out, out  # the result's error names the shutdown
    _, cache = learned_cache.read(tmp_path / "dynamic.bin")
    assert len(cache) > 0, "the dynamic n-gram cache was not saved with the request's n-grams"
