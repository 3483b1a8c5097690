"""MTP in the node's pure parts and the bench's plan: the Gemma 4 profile, the parameter checks, the
runners. No ROS graph here (test/ros_tools/test_linked_head_ros2_cli.py has the launch)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gemma_spec_ros.engine.drafters.mtp import is_assistant
from gemma_spec_ros.engine.drafters.registry import model_kind
from gemma_spec_ros.node.parameters import check_values, defaults, engine_config_from
from gemma_spec_dev.bench import config as bench_config
from support.node import config_values
from support.tiny_gemma4 import write_gemma4_pair


def test_the_gemma4_profile_is_the_mtp_profile(repo_root: Path) -> None:
    e4b = engine_config_from(config_values(repo_root, "gemma4_e4b.yaml"))
    assert e4b.spec.mode == "mtp" and e4b.spec.adaptive and e4b.target.flash_attn
    assert e4b.target.path == "/opt/models/gemma-4-E4B-it-Q4_K_M.gguf"
    assert e4b.draft is not None and e4b.draft.path == "/opt/models/gemma-4-E4B-it-assistant-Q8_0.gguf"
    assert e4b.draft.n_ctx == e4b.target.n_ctx  # the assistant reads the target's cache
    assert e4b.target.n_gpu_layers == e4b.draft.n_gpu_layers == -1


def test_mtp_without_an_assistant_is_refused_with_a_reason() -> None:
    assert "needs a Gemma 4 assistant" in check_values({**defaults(), "spec.mode": "mtp"}, configured=False)


def test_the_bench_plans_mtp_runners_only_for_an_assistant(tmp_path: Path) -> None:
    """An assistant drafts in mtp (ours) and draft-mtp (llama.cpp's llama-speculative-simple); a
    standalone draft model in the draft modes; the two never swap."""
    target, assistant = write_gemma4_pair(tmp_path)
    assert is_assistant(str(assistant)) and not is_assistant(str(target))
    assert model_kind(str(assistant)).name == "mtp" and model_kind(str(target)).name == "draft"
    (tmp_path / "llama-speculative-simple").write_text("")
    specs, notes = bench_config.plan_runners(["off", "draft", "mtp"], [3], True, [], str(tmp_path), [3],
                                             "", model_kind="mtp")
    assert [(s.name, s.mode) for s in specs] == [("off", "off"), ("mtp/K3", "mtp"),
                                                 ("native-spec-mtp/K3", "speculative-mtp")]
    assert any("mode draft skipped" in n and "assistant" in n for n in notes)
    specs, notes = bench_config.plan_runners(["off", "draft", "mtp"], [3], True, [], str(tmp_path), [3], "")
    assert [s.name for s in specs] == ["off", "draft/K3", "native-spec/K3"]
    assert any("mode mtp skipped" in n for n in notes)


def test_the_native_mtp_runner_runs_llama_cpps_draft_mtp(tmp_path: Path) -> None:
    """The bench's reference: llama-speculative-simple --spec-type draft-mtp on the agreeing pair,
    its timings parsed (run again if the tool's log thread lost them at exit)."""
    from support.servers import NATIVE_BIN
    from gemma_spec_dev.bench.native import NativeRunner

    if not (NATIVE_BIN / "llama-speculative-simple").is_file():
        pytest.skip(f"llama-speculative-simple not built in {NATIVE_BIN} (scripts/build_native_tools.sh)")
    target, assistant = write_gemma4_pair(tmp_path, agreeing=True)
    params = {"target.model_path": str(target), "target.n_ctx": 512, "target.n_threads": 1,
              "draft.model_path": str(assistant), "spec.p_min": 0.5}
    spec = bench_config.RunnerSpec("native-spec-mtp/K3", "native", "speculative-mtp", 3)
    runner = NativeRunner(spec, params, str(NATIVE_BIN), tmp_path, 0)
    command = runner.info["command"]
    assert command[command.index("--spec-type") + 1] == "draft-mtp"
    assert command[command.index("-md") + 1] == str(assistant)
    assert command[command.index("--spec-draft-p-min") + 1] == "0.5"
    assert command[command.index("-fa") + 1] == "off"  # as our engine: target.flash_attn defaults to false
    for _ in range(5):  # several short runs: the retry is what keeps them all parsed
        result = runner.run({"prompt": "the robot picks up the red cup. ", "max_tokens": 40,
                             "temperature": 0.0, "seed": 1})
        assert result.n_tokens >= 39 and result.stats["num_draft_tokens"] > 0
        assert result.stats["acceptance_rate"] == 1.0
