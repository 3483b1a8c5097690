"""The lifecycle and parameter services answer while a transition runs (real rclpy, real model).

What a lifecycle manager, an operator's ``ros2 lifecycle get`` / ``ros2 param get`` and a robot's
monitoring see while the node is busy: configure loading the embedded model and calibrating the
policy's pass costs (a real slow configure, ~20 s on two shared cores; seconds to minutes on a robot
with a 4 GB model), and deactivate waiting for the running goal, which is inside one long prompt
pass (n_batch = the prompt's length, so it cannot stop earlier). Also: one transition at a time,
and a transition the current state has no edge for is answered ``success: false``.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus

from gemma_spec_ros.client import GenerateClient, key_values, wait_until
from support.node import ServedNode

#: The longest an answer may take while the node is busy.
ANSWER_WITHIN = 1.0
LONG_PROMPT = " ".join(f"step {i}: check the gripper, then the arm." for i in range(140))


def timed(call: Callable[[], Any]) -> Tuple[Any, float]:
    started = time.monotonic()
    value = call()
    return value, time.monotonic() - started


class Background:
    """A blocking client call (a transition) on a thread of its own; ``result`` once it returns."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self._thread = threading.Thread(target=lambda: setattr(self, "result", call()), daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the transition did not return"
        return self.result


def sample_while(transition: Background, client: GenerateClient, busy_state: str) -> List[Dict[str, Any]]:
    """Ask ``~/get_state`` and ``~/get_parameters`` over and over while ``transition`` runs: what each
    answered and how long it took."""
    samples = []
    while transition.running():
        state, state_seconds = timed(client.state)
        values, param_seconds = timed(lambda: client.get_parameters(["spec.mode", "target.n_ctx"]))
        samples.append(dict(state=state, state_s=state_seconds, params=values, params_s=param_seconds))
        time.sleep(0.1)
    busy = [s for s in samples if s["state"] == busy_state]
    assert len(busy) >= 3, f"the node was seen {busy_state} only {len(busy)} times: {samples}"
    return busy


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], embedded_model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> ServedNode:
    folder = tmp_path_factory.mktemp("lifecycle")
    values = {"target.model_path": str(embedded_model_path), "target.n_ctx": 2048, "target.n_batch": 2048,
              "target.n_threads": 1, "spec.mode": "lookup", "limits.max_prompt_tokens": 1900,
              "lookup.dynamic_path": str(folder / "dynamic.bin"), "lookup.cache_dir": str(folder),
              "diagnostics.period": 0.2}
    served = node_client("gemma_spec_lifecycle", values, activate=False)
    assert served.client.state() == "unconfigured"  # discovery done before anything is timed
    return served


@pytest.mark.timeout(300)
def test_state_and_parameters_answer_within_a_second_while_configure_loads(served: ServedNode) -> None:
    """Before: the lifecycle and parameter services shared the node's default (mutually exclusive)
    callback group with ``change_state``, so ``get_state`` and ``get_parameters`` waited for the
    whole configure. While configuring: the state reads ``configuring`` (diagnostics too, level
    OK), parameter changes are refused with the reason, a second transition is refused at once."""
    client = served.client
    configure = Background(lambda: client.transition("configure"))
    wait_until(lambda: client.state() == "configuring", 30, "configure to start")
    diagnosed = client.wait_status(served.status_name, lambda s: key_values(s)["state"] == "configuring")
    assert diagnosed.level == DiagnosticStatus.OK and diagnosed.message == "configuring"
    [refused] = client.set_parameters(spec__draft_max=4)
    assert not refused.successful and "configuring" in refused.reason
    again, seconds = timed(lambda: client.transition("activate"))
    assert again is False and seconds < ANSWER_WITHIN
    busy = sample_while(configure, client, "configuring")
    assert configure.join(60) is True and client.state() == "inactive"
    slowest = max(max(s["state_s"], s["params_s"]) for s in busy)
    assert slowest < ANSWER_WITHIN, busy
    assert all(s["params"] == {"spec.mode": "lookup", "target.n_ctx": 2048} for s in busy), busy
    client.wait_status(served.status_name, lambda s: s.level == DiagnosticStatus.OK and s.message == "inactive")


@pytest.mark.timeout(300)
def test_state_and_parameters_answer_within_a_second_while_deactivate_waits(served: ServedNode) -> None:
    """deactivate waits for the running goal, here inside a prompt pass of ~1500 tokens in one
    llama_decode: ``get_state`` reads ``deactivating`` and parameters answer meanwhile."""
    client = served.client
    if client.state() == "unconfigured":
        assert client.transition("configure")
    assert client.transition("activate")
    run = client.send(prompt=LONG_PROMPT, max_tokens=4, temperature=0.0)
    assert run.accepted
    client.wait_status(served.status_name, lambda s: key_values(s)["running"] == "True")
    deactivate = Background(lambda: client.transition("deactivate"))
    busy = sample_while(deactivate, client, "deactivating")
    assert deactivate.join(60) is True and client.state() == "inactive"
    slowest = max(max(s["state_s"], s["params_s"]) for s in busy)
    assert slowest < ANSWER_WITHIN, busy
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_ABORTED and result.finish_reason == "cancelled"


@pytest.mark.timeout(120)
def test_a_transition_the_state_does_not_have_is_refused_and_the_node_keeps_serving(served: ServedNode) -> None:
    """``ros2 lifecycle set configure`` on an active node: rclpy raised inside the service callback,
    which stopped the executor (before: the node answered nothing more, and its process exited 1).
    Now: success false, the reason logged, the node serves on."""
    client = served.client
    if client.state() == "unconfigured":
        assert client.transition("configure")
    if client.state() == "inactive":
        assert client.transition("activate")
    mark = client.log_mark()
    assert client.transition("configure") is False
    client.wait_log("transition", since=mark)
    assert client.state() == "active"
    run = client.send(prompt="The robot checks the arm.", max_tokens=4, temperature=0.0)
    assert run.accepted and run.wait_result().finish_reason in ("stop", "length")
