"""Helpers that drive the real `ros2 launch` and `ros2` CLI in subprocesses, as a user does, for
ros_tools/test_ros2_cli.py and ros_tools/test_linked_head_ros2_cli.py.

The tools (launch, launch_ros, ros2cli: Jazzy, from source) are not on any package registry; CI
installs them with ``../shared/ros2-tools/install.sh .venv``. Without them, importing this module
skips the test module that imports it, saying so.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import yaml

try:
    import launch_ros  # noqa: F401
    import ros2cli  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    pytest.skip("the ROS 2 launch / ros2 CLI tools are not installed in this venv "
                "(run ../shared/ros2-tools/install.sh .venv, as .ci/run does)", allow_module_level=True)

VENV = Path(sys.prefix)
NODE = "/gemma_spec"  # the launch file's node name
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
#: Run by the child before exec: restore SIGINT, which a non-interactive shell's background job
#: inherits ignored (then neither Ctrl-C nor ros2's KeyboardInterrupt handling would work).
_EXEC_WITH_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "os.execvp(sys.argv[1], sys.argv[1:])")


def ros_env() -> Dict[str, str]:
    """The environment a user gets after `make setup` + the tools: the venv as the ament prefix."""
    env = dict(os.environ)
    env["AMENT_PREFIX_PATH"] = str(VENV)
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # conftest also sets its own domain id
    env["OMP_WAIT_POLICY"] = "passive"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def ros2(*args: str, timeout: float = 90.0, check: bool = True, env: Optional[Dict[str, str]] = None) -> str:
    """Run one `ros2 ...` command to its end; its stdout + stderr. "Node not found" is retried for
    a while: the CLI asks its daemon, whose view of a node that just started can lag behind.
    ``env``: another environment than :func:`ros_env` (a sourced workspace)."""
    deadline = time.monotonic() + 20.0
    while True:
        done = subprocess.run([str(VENV / "bin" / "ros2"), *args], env=env or ros_env(), capture_output=True,
                              text=True, timeout=timeout)
        out = done.stdout + done.stderr
        if "Node not found" not in out or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if check:
        assert done.returncode == 0, f"ros2 {' '.join(args)} exited {done.returncode}:\n{out}"
    return out


class Background:
    """A command in its own process group with SIGINT restored, output to a file we poll."""

    def __init__(self, args: List[str], log: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.log = log
        self._file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_SIGINT, *args], env=env or ros_env(),
                                     stdout=self._file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.output:
            if self.proc.poll() is not None and needle not in self.output:
                raise AssertionError(f"exited {self.proc.returncode} before {needle!r}:\n{self.output}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} within {timeout:.0f} s:\n{self.output}")
            time.sleep(0.1)
        return self.output

    def interrupt(self, timeout: float = 60.0) -> int:
        """SIGINT to the whole process group, as Ctrl-C in a terminal; the exit status."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._file.close()


def params_file(tmp: Path, model: Path, **overrides: object) -> Path:
    """config/embedded.yaml with a small context, a fixed K and a dynamic cache in ``tmp``."""
    repo = Path(__file__).resolve().parents[2]
    document = yaml.safe_load((repo / "gemma_spec_ros" / "config" / "embedded.yaml").read_text())
    params = document["/**"]["ros__parameters"]
    params["target"].update(model_path=str(model), n_ctx=512)
    params["spec"].update(adaptive=False, draft_max=3)
    params["lookup"].update(dynamic_path=str(tmp / "dynamic.bin"), cache_dir=str(tmp))
    params["diagnostics"]["period"] = 0.5
    for dotted, value in overrides.items():
        group, name = dotted.split(".", 1)
        params.setdefault(group, {})[name] = value
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def launch(tmp: Path, params: Path, *extra: str) -> Background:
    return Background([str(VENV / "bin" / "ros2"), "launch", "gemma_spec_ros", "orin.launch.py",
                       f"params_file:={params}", *extra], tmp / "launch.log")


def wait_state(state: str, timeout: float = 120.0, env: Optional[Dict[str, str]] = None) -> None:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        out = ros2("lifecycle", "get", NODE, check=False, env=env)
        if out.startswith(state):
            return
        time.sleep(0.5)
    raise AssertionError(f"{NODE} not {state} within {timeout:.0f} s: {out}")


def goal_yaml(max_tokens: int, **fields: object) -> str:
    goal = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "seed": 1, **fields}
    return yaml.safe_dump(goal, default_flow_style=True, width=10_000).strip()


def send_goal(tmp: Path, max_tokens: int, name: str = "goal", env: Optional[Dict[str, str]] = None,
              **fields: object) -> Background:
    return Background([str(VENV / "bin" / "ros2"), "action", "send_goal", "--feedback",
                       f"{NODE}/generate", "gemma_spec_msgs/action/Generate",
                       goal_yaml(max_tokens, **fields)], tmp / f"{name}.log", env)


def send_accepted_goal(tmp: Path, max_tokens: int, name: str = "goal", env: Optional[Dict[str, str]] = None,
                       timeout: float = 45.0, **fields: object) -> Background:
    """:func:`send_goal`, waited on until the CLI prints the server's answer ("Goal accepted" or
    "Goal was rejected"), and sent once more if none comes within ``timeout``: the CLI's rclpy
    ``ActionClient`` can miss the answer and wait forever (a race in ``send_goal_async``,
    ros2/rclpy#1123; seen here once in about six full runs: "Sending goal:" and nothing more for
    90 s while the node served). A goal the server did accept then runs beside the one sent again."""
    goal = send_goal(tmp, max_tokens, name, env, **fields)
    for attempt in (1, 2):
        try:
            deadline = time.monotonic() + timeout
            while "Goal accepted" not in goal.output and "Goal was rejected" not in goal.output:
                if goal.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no answer to the goal within {timeout:.0f} s:\n{goal.output}")
                time.sleep(0.1)
            return goal
        except AssertionError:
            if attempt == 2 or goal.proc.poll() is not None:
                raise
            goal.close()
            goal = send_goal(tmp, max_tokens, f"{name}_again", env, **fields)
    raise AssertionError("unreachable")  # pragma: no cover


def send_chat_goal(tmp: Path, goal: Dict[str, object], name: str = "chat") -> Background:
    """`ros2 action send_goal --feedback <node>/generate_chat gemma_spec_msgs/action/GenerateChat` with
    ``goal`` (its fields, as YAML)."""
    return Background([str(VENV / "bin" / "ros2"), "action", "send_goal", "--feedback",
                       f"{NODE}/generate_chat", "gemma_spec_msgs/action/GenerateChat",
                       yaml.safe_dump(goal, default_flow_style=True, width=10_000).strip()], tmp / f"{name}.log")
