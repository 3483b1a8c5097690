"""The Gemma 4 self-draft paths as a robotics engineer walks them: `ros2 launch ... spec_mode:=mtp` on
the E4B profile and `spec_mode:=eagle3` on the 26B-A4B profile.

Each profile (config/gemma4_e4b.yaml: E4B-it + its MTP assistant; config/gemma4_26b_a4b.yaml:
26B-A4B-it + its EAGLE-3 head) has its two model paths pointed at a tiny agreeing pair
(support/tiny_gemma4.py, support/tiny_eagle3.py; no real Gemma 4 weights can be had here): the real
`ros2 launch`, `ros2 action send_goal`, `ros2 topic echo` and `ros2 param set` in subprocesses, as in
test_ros2_cli.py, with the same helpers (support/ros2_cli.py, whose skip without the ROS 2 CLI tools
applies here too).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Tuple

import pytest
import yaml

from support.ros2_cli import NODE, launch, ros2, send_goal, wait_state
from support.tiny_eagle3 import write_eagle3_pair
from support.tiny_gemma4 import write_gemma4_pair


@dataclass(frozen=True)
class Kind:
    """One linked-head drafter as its profile ships it."""

    mode: str
    profile: str
    write_pair: Callable[..., Tuple[Path, Path]]
    draft_path_word: str  # in the profile's draft.model_path
    architecture: str  # the draft's general.architecture on /diagnostics
    other_mode: str  # a mode the loaded draft cannot serve
    refusal: str  # part of the reason `ros2 param set spec.mode other_mode` is refused with


KINDS = {
    "mtp": Kind("mtp", "gemma4_e4b.yaml", write_gemma4_pair, "assistant", "gemma4-assistant", "draft",
                "names a Gemma 4 assistant"),
    "eagle3": Kind("eagle3", "gemma4_26b_a4b.yaml", write_eagle3_pair, "eagle3", "eagle3", "mtp",
                   "names an EAGLE-3 head"),
}


@pytest.fixture
def own_domain(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ROS domain of this test alone (test_ros2_cli's nodes have the same name), and no CLI
    daemon left behind."""
    monkeypatch.setenv("ROS_DOMAIN_ID", str(1 + (int(os.environ["ROS_DOMAIN_ID"]) + 30) % 100))
    yield
    ros2("daemon", "stop", check=False, timeout=30)


def params_file(kind: Kind, tmp: Path, repo_root: Path) -> Path:
    """The kind's profile with the tiny pair, CPU sizes, a fixed K and a fast diagnostics period."""
    target, draft = kind.write_pair(tmp / "models", agreeing=True)
    document = yaml.safe_load((repo_root / "gemma_spec_ros" / "config" / kind.profile).read_text())
    params = document["/**"]["ros__parameters"]
    assert params["spec"]["mode"] == kind.mode and kind.draft_path_word in params["draft"]["model_path"]
    params["target"].update(model_path=str(target), n_gpu_layers=0, n_ctx=512, n_threads=1,
                            flash_attn=False)
    params["draft"].update(model_path=str(draft), n_gpu_layers=0, n_threads=1)
    params["spec"].update(mode="lookup", adaptive=False, draft_max=3)  # the launch argument sets the kind
    params["lookup"].update(dynamic_path=str(tmp / "dynamic.bin"), cache_dir=str(tmp))
    params["diagnostics"] = {"period": 0.5}
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", sorted(KINDS))
def test_launch_with_the_kinds_spec_mode_serves_a_goal_and_names_the_drafter(
        name: str, tmp_path: Path, repo_root: Path, own_domain: None) -> None:
    kind = KINDS[name]
    proc = launch(tmp_path, params_file(kind, tmp_path, repo_root), f"spec_mode:={kind.mode}")
    try:
        wait_state("active")
        assert f"spec.mode={kind.mode}" in proc.wait_for("configured in"), proc.output
        goal = send_goal(tmp_path, 40)
        goal.proc.wait(120)
        out = goal.output
        goal.close()
        assert "Goal finished with status: SUCCEEDED" in out, out
        assert "finish_reason: length" in out and "completion_tokens: 40" in out, out
        assert f"spec_mode: {kind.mode}" in out, out
        result = out.split("Result:")[1]
        assert "num_drafts: 0" not in result and "mean_acceptance_length: 1.0\n" not in result, result
        diagnostics = ros2("topic", "echo", "--once", "/diagnostics", "diagnostic_msgs/msg/DiagnosticArray",
                           timeout=60)
        models = diagnostics.split("name: 'gemma_spec: models'")[1]
        assert f"key: draft.drafter\n    value: {kind.mode}" in models, models
        assert f"key: draft.architecture\n    value: {kind.architecture}" in models, models
        refused = ros2("param", "set", NODE, "spec.mode", kind.other_mode, check=False)
        assert "Setting parameter failed" in refused and kind.refusal in refused, refused
    finally:
        status = proc.interrupt()
    assert status == 0, proc.output
