"""EAGLE-3 in the node: the Gemma 4 26B-A4B profile and the parameter checks (pure), a served node on
the tiny agreeing gemma4 + eagle3 pair (real rclpy over loopback DDS, real llama.cpp), and the
bench's plan and llama.cpp's own draft-eagle3 runner. test/ros_tools/test_linked_head_ros2_cli.py has the
``ros2 launch``."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

import pytest

from gemma_spec_ros.client import key_values
from gemma_spec_ros.engine.drafters.eagle3 import is_eagle3_head
from gemma_spec_ros.engine.drafters.registry import model_kind
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.parameters import check_values, defaults, engine_config_from
from gemma_spec_dev.bench import config as bench_config
from support.node import ServedNode, config_values, greedy_goal
from support.tiny_eagle3 import write_eagle3_pair
from support.tiny_gguf import write_tiny_gguf

NODE = "gemma_spec_eagle3"
MODELS_STATUS = f"{NODE}: models"
PROMPT = "the robot picks up the red cup. "
K = 3


def test_the_gemma4_26b_a4b_profile_is_the_eagle3_profile(repo_root: Path) -> None:
    """config/gemma4_26b_a4b.yaml read through the node's parameter table."""
    values = config_values(repo_root, "gemma4_26b_a4b.yaml")
    assert check_values(values, configured=False) == ""
    profile = engine_config_from(values)
    assert profile.spec.mode == "eagle3" and profile.spec.adaptive and profile.target.flash_attn
    assert profile.target.path == "/opt/models/gemma-4-26B-A4B-it-Q4_K_M.gguf"
    assert profile.draft is not None and profile.draft.path == "/opt/models/gemma-4-26B-A4B-it-eagle3-F16.gguf"
    assert profile.draft.n_ctx == profile.target.n_ctx  # the head's cache holds the target's positions
    assert profile.target.n_gpu_layers == profile.draft.n_gpu_layers == -1
    text = (repo_root / "gemma_spec_ros" / "config" / "gemma4_26b_a4b.yaml").read_text()
    assert "RedHatAI/gemma-4-26B-A4B-it-speculator.eagle3" in text and "gemma-spec-eagle3-convert" in text
    assert "Memory (estimated, not measured)" in text


def test_eagle3_without_a_head_is_refused_with_a_reason() -> None:
    reason = check_values({**defaults(), "spec.mode": "eagle3"}, configured=False)
    assert "needs an EAGLE-3 head" in reason, reason


def test_the_bench_plans_eagle3_runners_only_for_a_head(tmp_path: Path) -> None:
    """A head drafts in eagle3 (ours) and draft-eagle3 (llama.cpp's llama-speculative-simple); the
    other drafters' modes are skipped with the reason, and eagle3 without a head."""
    target, head = write_eagle3_pair(tmp_path)
    assert is_eagle3_head(str(head)) and not is_eagle3_head(str(target))
    assert model_kind(str(head)).name == "eagle3" and model_kind(str(target)).name == "draft"
    (tmp_path / "llama-speculative-simple").write_text("")
    modes = ["off", "draft", "mtp", "eagle3"]
    specs, notes = bench_config.plan_runners(modes, [3], True, [], str(tmp_path), [3], "", model_kind="eagle3")
    assert [(s.name, s.mode) for s in specs] == [("off", "off"), ("eagle3/K3", "eagle3"),
                                                 ("native-spec-eagle3/K3", "speculative-eagle3")]
    assert any("mode draft skipped" in n and "EAGLE-3 head" in n for n in notes), notes
    assert any("mode mtp skipped" in n and "EAGLE-3 head" in n for n in notes), notes
    specs, notes = bench_config.plan_runners(modes, [3], False, [], "", [3], "")
    assert [s.name for s in specs] == ["off"]
    assert any("mode eagle3 skipped" in n and "needs an EAGLE-3 head" in n for n in notes), notes
    specs, notes = bench_config.plan_runners(["off", "eagle3"], [3], True, [], "", [3], "", model_kind="mtp")
    assert [s.name for s in specs] == ["off"] and any("Gemma 4 assistant" in n for n in notes), notes


def test_the_native_eagle3_runner_runs_llama_cpps_draft_eagle3(tmp_path: Path) -> None:
    """The bench's reference: llama-speculative-simple --spec-type draft-eagle3 on the agreeing pair,
    its timings parsed."""
    from support.servers import NATIVE_BIN
    from gemma_spec_dev.bench.native import NativeRunner

    if not (NATIVE_BIN / "llama-speculative-simple").is_file():
        pytest.skip(f"llama-speculative-simple not built in {NATIVE_BIN} (scripts/build_native_tools.sh)")
    target, head = write_eagle3_pair(tmp_path, agreeing=True)
    params = {"target.model_path": str(target), "target.n_ctx": 512, "target.n_threads": 1,
              "draft.model_path": str(head), "spec.p_min": 0.5}
    spec = bench_config.RunnerSpec("native-spec-eagle3/K3", "native", "speculative-eagle3", 3)
    runner = NativeRunner(spec, params, str(NATIVE_BIN), tmp_path, 0)
    command = runner.info["command"]
    assert command[command.index("--spec-type") + 1] == "draft-eagle3"
    assert command[command.index("-md") + 1] == str(head)
    assert command[command.index("--spec-draft-p-min") + 1] == "0.5"
    result = runner.run({"prompt": PROMPT, "max_tokens": 40, "temperature": 0.0, "seed": 1})
    assert result.n_tokens >= 39 and result.stats["num_draft_tokens"] > 0
    assert result.stats["acceptance_rate"] > 0.9, result.stats


# -- a served node in eagle3 mode --------------------------------------------------------------------
@pytest.fixture(scope="module")
def values(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    target, head = write_eagle3_pair(tmp_path_factory.mktemp("eagle3_node"), agreeing=True)
    return {"target.model_path": str(target), "target.n_ctx": 512, "target.n_threads": 1,
            "draft.model_path": str(head), "draft.n_threads": 1, "spec.mode": "eagle3",
            "spec.draft_max": K, "spec.adaptive": False, "spec.p_min": 0.5,
            "generation.max_tokens": 16, "limits.max_tokens": 200, "limits.max_prompt_tokens": 200,
            "diagnostics.period": 0.2}


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], values: Dict[str, Any]) -> ServedNode:
    return node_client(NODE, values, activate=False)


@pytest.mark.timeout(300)
def test_a_node_in_eagle3_mode_refuses_a_gemma3_target_then_serves_a_goal(
        served: ServedNode, values: Dict[str, Any], tmp_path: Path) -> None:
    """configure fails with the reason (never an abort) for a Gemma 3 target, whose llama.cpp graph
    exports no layer features; with the Gemma 4 target the node configures, a goal in eagle3 mode
    succeeds with drafts accepted, and /diagnostics names the drafter."""
    client = served.client
    gemma3 = write_tiny_gguf(tmp_path / "gemma3.gguf", vocab_size=256, n_embd=64, n_layer=2, arch="gemma3")
    try:
        [result] = client.set_parameters(target__model_path=str(gemma3))
        assert result.successful, result.reason
        mark = client.log_mark()
        assert client.transition("configure") is False
        assert client.state() == "unconfigured"
        refusal = client.wait_log("exports them only for targets of architecture", since=mark).msg
        assert "configure failed" in refusal and "is gemma3" in refusal, refusal
        failed = client.wait_status(spec_status_name(NODE), lambda s: "layer features" in s.message)
        assert failed.message.startswith("configure failed"), failed.message
    finally:
        client.set_parameters(target__model_path=values["target.model_path"])
    assert client.transition("configure") is True and client.transition("activate") is True
    run = client.send(**greedy_goal(PROMPT, 60))
    assert run.accepted
    answer = run.wait_result()
    assert answer.finish_reason == "length" and answer.completion_tokens == 60, answer
    assert answer.spec_mode == "eagle3" and answer.stats.num_drafts > 0
    assert answer.stats.acceptance_rate > 0.9 and len(answer.stats.acceptance_per_position) == K
    models = key_values(client.wait_status(MODELS_STATUS))
    assert models["draft.drafter"] == "eagle3" and models["draft.architecture"] == "eagle3", models
    assert models["draft.path"] == values["draft.model_path"]
    [refused] = client.set_parameters(spec__mode="mtp")
    assert not refused.successful and "names an EAGLE-3 head" in refused.reason, refused.reason
