"""The fresh-robot rehearsal: the README's "On a robot" commands, on a machine that has only the models.

A colcon workspace (colcon from PyPI) holding a copy of this repository is built against the venv's
ROS 2, as a robot builds it against /opt/ros; a fresh ``HOME`` holds nothing but ``models/`` with the
embedded model under the two file names gemma_spec_ros/config/orin.yaml expects (the CPU build ignores
``n_gpu_layers``; every other value of the profile is kept: n_ctx 4096, the draft model, K 8, the
adaptive policy). Then, from the workspace's ``install/setup.bash``, as the README says:

1. ``ros2 launch gemma_spec_ros orin.launch.py models_dir:=$HOME/models spec_mode:=draft``;
   ``ros2 lifecycle get`` answers while the node configures (it reads ``configuring``);
2. active; a goal succeeds in every mode the profile allows (``ros2 action send_goal``);
3. ``kill -9`` of the node: the launch respawns it and it is active again without a hand;
4. Ctrl-C (SIGINT to the launch's process group) during a goal: the goal gets its result, the
   learned n-gram cache is saved in the folder the node created (``~/.cache/gemma_spec_ros``, 0700),
   every process exits 0.

The robot-only steps are replaced, each by what it provides here (:data:`REPLACED`); every other
command is run as the README writes it, and the test checks that the README still writes it so.
"""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import yaml

from gemma_spec_ros.engine.drafters import learned_cache
from gemma_spec_ros.engine.modes import MODES as SPEC_MODES
from support.ros2_cli import NODE, VENV, Background, ros2, send_accepted_goal, send_goal, wait_state

REPO = Path(__file__).resolve().parents[2]
if not (VENV / "bin" / "colcon").exists():  # pragma: no cover - depends on the machine
    pytest.skip("colcon is not installed in this venv (scripts/setup.sh installs it from PyPI)",
                allow_module_level=True)
#: The README's robot commands this test runs, verbatim.
BUILD = "colcon build --packages-skip gemma_spec_dev"
SOURCE = "source install/setup.bash"
LAUNCH = "ros2 launch gemma_spec_ros orin.launch.py models_dir:=$HOME/models spec_mode:=draft"
#: The README's robot-only steps, and what provides the same here.
REPLACED = {
    "source /opt/ros/humble/setup.bash": "the venv's ROS 2 (Jazzy wheels): AMENT_PREFIX_PATH, CMAKE_PREFIX_PATH, "
                                         "PATH and VIRTUAL_ENV name the venv",
    "git clone <this repository> gemma_spec_ros": "a copy of this checkout's files (tracked and new)",
    "rosdep install": "nothing: the venv holds every dependency",
    "pip install": "the venv's Python packages (llama-cpp-python's CPU build among them)",
}
#: orin.yaml's model file names (the launch file's models_dir joins them).
MODEL_FILES = ("gemma-3-4b-it-q4_0.gguf", "gemma-3-1b-it-q4_0.gguf")
#: Every spec mode orin.yaml's pair allows (a draft model; no MTP assistant, no EAGLE-3 head).
MODES = tuple(name for name, mode in SPEC_MODES.items() if mode.needs in ("", "draft"))


def robot_section() -> str:
    readme = (REPO / "README.md").read_text()
    return readme.split("## On a robot", 1)[1].split("\n## ", 1)[0]


def robot_env(home: Path) -> Dict[str, str]:
    """What ``source /opt/ros/humble/setup.bash`` gives a robot's shell, with the venv as the ROS
    install; a fresh HOME; DDS on this host, on a domain of this test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMENT_", "COLCON_", "PYTHONPATH"))}
    env.update(HOME=str(home), AMENT_PREFIX_PATH=str(VENV), CMAKE_PREFIX_PATH=str(VENV), VIRTUAL_ENV=str(VENV),
               PATH=f"{VENV / 'bin'}:{os.environ.get('PATH', '')}", ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
               ROS_DOMAIN_ID=str(1 + (int(os.environ["ROS_DOMAIN_ID"]) + 40) % 100),
               OMP_WAIT_POLICY="passive", PYTHONUNBUFFERED="1")
    return env


def sourced(workspace: Path, env: Dict[str, str]) -> Dict[str, str]:
    """The environment after ``source install/setup.bash`` in ``workspace``."""
    out = subprocess.run(["bash", "-c", f"{SOURCE} && env -0"], cwd=workspace, env=env,
                         capture_output=True, check=True, timeout=60).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def copy_checkout(target: Path) -> None:
    """This checkout's files as `git clone` would give them, plus new files not yet committed."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())


@pytest.fixture(scope="module")
def robot(tmp_path_factory: pytest.TempPathFactory, embedded_model_path: Path) -> Iterator[Dict[str, object]]:
    """A fresh home with only the models, and the workspace built with the README's command: its
    sourced environment, and how long the build took."""
    tmp = tmp_path_factory.mktemp("robot")
    home = tmp / "home"
    (home / "models").mkdir(parents=True)
    for name in MODEL_FILES:
        (home / "models" / name).symlink_to(embedded_model_path)
    workspace = home / "ros2_ws"
    copy_checkout(workspace / "src" / "gemma_spec_ros")
    env = robot_env(home)
    started = time.monotonic()
    built = subprocess.run(["bash", "-c", BUILD], cwd=workspace, env=env, capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    yield {"home": home, "workspace": workspace, "env": sourced(workspace, env), "logs": tmp,
           "build_s": time.monotonic() - started}
    ros2("daemon", "stop", check=False, timeout=30, env=sourced(workspace, env))


def test_the_readme_robot_section_is_what_the_rehearsal_runs() -> None:
    section = robot_section()
    for command in (BUILD, SOURCE, LAUNCH, f"ros2 lifecycle get {NODE}", "ros2 action send_goal"):
        assert command in section, f"the README's robot section no longer says {command!r}"
    for command in REPLACED:
        assert command in section, f"the README's robot section no longer says {command!r}"
    assert "respawn" in section and "kill -9" in section and "~/.cache/gemma_spec_ros" in section


def started_pids(log: str) -> List[int]:
    return [int(pid) for pid in re.findall(r"process started with pid \[(\d+)\]", log)]


def printed_result(out: str) -> dict:
    """The Result block `ros2 action send_goal` prints, as a dict."""
    return yaml.safe_load(out.split("Result:", 1)[1].split("Goal finished with status", 1)[0].strip())


@pytest.mark.timeout(900)
def test_a_fresh_robot_serves_every_mode_respawns_after_kill_9_and_stops_on_ctrl_c(robot: Dict[str, object]) -> None:
    home, workspace, env = Path(robot["home"]), Path(robot["workspace"]), robot["env"]
    logs = Path(robot["logs"])
    assert env["AMENT_PREFIX_PATH"].startswith(str(workspace / "install")), env["AMENT_PREFIX_PATH"]
    ros2("daemon", "start", check=False, env=env)  # the CLI's first answers come fast
    started = time.monotonic()
    launch = Background(["bash", "-c", f"exec {LAUNCH}"], logs / "launch.log", env=env)
    try:
        # 1. ros2 lifecycle get answers while the models load (before: it waited for the whole configure)
        seen: List[Tuple[float, str]] = []  # (when the answer came, since the node said "configuring")
        while not seen or not seen[-1][1].startswith("active"):
            assert launch.proc.poll() is None and "process has died" not in launch.output, launch.output
            assert time.monotonic() - started < 300, f"not active within 300 s: {seen}\n{launch.output}"
            out = ros2("lifecycle", "get", NODE, check=False, env=env, timeout=60)
            seen.append((time.monotonic(), out.strip()))
        configure = re.search(r"configured in ([0-9.]+) s", launch.output)
        assert configure, launch.output
        asked_first = seen[0][0] - started
        # an answer can only read "configuring" if one came before the configure ended: on a quiet
        # host the embedded models configure in ~4 s, about what the CLI's first answer takes
        if asked_first < float(configure.group(1)):
            assert any(state.startswith("configuring") for _, state in seen), seen
        cache_dir = home / ".cache" / "gemma_spec_ros"
        assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700, "the node did not make its cache folder"

        # 2. a goal in every mode the profile allows, a few at a time (orin.yaml's queue.max_depth is 4)
        for first in range(0, len(MODES), 4):
            goals = {mode: send_goal(logs, 24, name=f"goal_{mode.replace('+', '_')}", env=env, spec_mode=mode)
                     for mode in MODES[first:first + 4]}
            for mode, goal in goals.items():
                goal.proc.wait(300)
                out = goal.output
                goal.close()
                assert "Goal finished with status: SUCCEEDED" in out, out
                result = printed_result(out)
                assert result["spec_mode"].startswith(mode) and result["completion_tokens"] > 0, result

        # 3. kill -9: respawned, configured and active again without a hand
        first = started_pids(launch.output)[-1]
        os.kill(first, signal.SIGKILL)
        died = launch.wait_for("process has died").split("process has died", 1)[1].splitlines()[0]
        assert str(workspace / "install" / "gemma_spec_ros" / "lib" / "gemma_spec_ros") in died, died
        deadline = time.monotonic() + 300
        while launch.output.count("ready: send goals") < 2:
            assert time.monotonic() < deadline, launch.output
            assert launch.proc.poll() is None, launch.output
            time.sleep(0.5)
        assert started_pids(launch.output)[-1] != first
        wait_state("active", timeout=60, env=env)

        # 4. Ctrl-C during a goal
        running = send_accepted_goal(logs, 400, name="running", env=env)
        running.wait_for("Feedback:", timeout=120)
    finally:
        status = launch.interrupt(timeout=120)
    try:
        running.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the goal's client got no result within 60 s of the exit\n{running.output}\n{launch.output}")
    out = running.output
    running.close()
    assert status == 0, launch.output
    assert "process has finished cleanly" in launch.output and "escalating" not in launch.output, launch.output
    assert "Goal finished with status: ABORTED" in out and "finish_reason: cancelled" in out, out
    assert "dynamic n-gram cache saved" in launch.output, launch.output
    _, cache = learned_cache.read(cache_dir / "lookup-learned.bin")
    assert len(cache) > 0, "the learned n-gram cache was not saved"
    print(f"\nrehearsal: colcon build {robot['build_s']:.0f} s, launch to Ctrl-C {time.monotonic() - started:.0f} s")
