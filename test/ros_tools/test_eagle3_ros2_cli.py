"""The EAGLE-3 path as a robotics engineer walks it: `ros2 launch ... spec_mode:=eagle3` on the Gemma 4
26B-A4B profile.

config/gemma4_26b_a4b.yaml (26B-A4B-it + its EAGLE-3 head) with its two model paths pointed at the
tiny agreeing gemma4 + eagle3 pair (support/tiny_eagle3.py; no real Gemma 4 weights can be had
here): the real `ros2 launch`, `ros2 action send_goal`, `ros2 topic echo` and `ros2 param set` in
subprocesses, as in test_ros2_cli.py, with the same helpers (support/ros2_cli.py, whose skip
without the ROS 2 CLI tools applies here too).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from support.ros2_cli import NODE, launch, ros2, send_goal, wait_state
from support.tiny_eagle3 import write_eagle3_pair


@pytest.fixture
def own_domain(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ROS domain of this test alone (test_ros2_cli's nodes have the same name), and no CLI
    daemon left behind."""
    monkeypatch.setenv("ROS_DOMAIN_ID", str(1 + (int(os.environ["ROS_DOMAIN_ID"]) + 60) % 100))
    yield
    ros2("daemon", "stop", check=False, timeout=30)


def eagle3_params_file(tmp: Path, repo_root: Path) -> Path:
    """config/gemma4_26b_a4b.yaml with the tiny pair, CPU sizes, a fixed K and a fast diagnostics period."""
    target, head = write_eagle3_pair(tmp / "models", agreeing=True)
    document = yaml.safe_load((repo_root / "gemma_spec_ros" / "config" / "gemma4_26b_a4b.yaml").read_text())
    params = document["/**"]["ros__parameters"]
    assert params["spec"]["mode"] == "eagle3" and "eagle3" in params["draft"]["model_path"]
    params["target"].update(model_path=str(target), n_gpu_layers=0, n_ctx=512, n_threads=1,
                            flash_attn=False)
    params["draft"].update(model_path=str(head), n_gpu_layers=0, n_threads=1)
    params["spec"].update(mode="lookup", adaptive=False, draft_max=3)  # the launch argument sets eagle3
    params["lookup"].update(dynamic_path=str(tmp / "dynamic.bin"), cache_dir=str(tmp))
    params["diagnostics"] = {"period": 0.5}
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.timeout(420)
def test_launch_with_spec_mode_eagle3_serves_a_goal_and_names_the_drafter(
        tmp_path: Path, repo_root: Path, own_domain: None) -> None:
    proc = launch(tmp_path, eagle3_params_file(tmp_path, repo_root), "spec_mode:=eagle3")
    try:
        wait_state("active")
        assert "spec.mode=eagle3" in proc.wait_for("configured in"), proc.output
        goal = send_goal(tmp_path, 40)
        goal.proc.wait(120)
        out = goal.output
        goal.close()
        assert "Goal finished with status: SUCCEEDED" in out, out
        assert "finish_reason: length" in out and "completion_tokens: 40" in out, out
        assert "spec_mode: eagle3" in out, out
        result = out.split("Result:")[1]
        assert "num_drafts: 0" not in result and "mean_acceptance_length: 1.0\n" not in result, result
        diagnostics = ros2("topic", "echo", "--once", "/diagnostics", "diagnostic_msgs/msg/DiagnosticArray",
                           timeout=60)
        models = diagnostics.split("name: 'gemma_spec: models'")[1]
        assert "key: draft.drafter\n    value: eagle3" in models, models
        assert "key: draft.architecture\n    value: eagle3" in models, models
        refused = ros2("param", "set", NODE, "spec.mode", "mtp", check=False)
        assert "Setting parameter failed" in refused and "names an EAGLE-3 head" in refused, refused
    finally:
        status = proc.interrupt()
    assert status == 0, proc.output
