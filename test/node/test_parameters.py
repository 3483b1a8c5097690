"""The node's pure parts: parameter table, shipped configs, goal conversion, stats formatting.

No ROS graph and no model here; the node on real rclpy is tested in test/node/test_inprocess.py and
test/node/test_serve.py.
"""
from __future__ import annotations

import doctest
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import pytest
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticStatus
from gemma_spec_msgs.action import Generate

from gemma_spec_ros.engine.stats import SpecStats
from gemma_spec_ros.engine.config import SpecConfig, check_params, param
from gemma_spec_ros.node import diagnostics, goals, messages
from gemma_spec_ros.node.messages import GoalRejected, request_from_goal
from gemma_spec_ros.node.parameters import (PARAMETERS, PARAMETERS_BY_NAME, check_values, config_of, defaults,
                                            engine_config_from, render_markdown, rows_of)
from gemma_spec_ros.tools import serve
from support.node import config_values

#: The names the rest of the project (launch file, README, configs) relies on.
EXPECTED_NAMES = """
target.model_path target.n_gpu_layers target.n_ctx target.n_batch target.n_threads target.flash_attn
target.prepare_grammar
draft.model_path draft.n_gpu_layers draft.n_ctx draft.n_threads draft.flash_attn spec.mode spec.draft_max
spec.draft_min spec.p_min spec.adaptive spec.verification lookup.static_path lookup.dynamic_path
lookup.cache_dir lookup.ngram_min lookup.ngram_max generation.max_tokens generation.temperature generation.top_p
generation.top_k generation.seed generation.time_budget generation.prompt_cache limits.max_prompt_tokens
limits.max_tokens queue.max_depth queue.max_running
limits.max_prompt_bytes limits.max_stop_strings limits.max_stop_length limits.max_grammar_bytes generation.grammar generation.json_schema queue.result_timeout lookup.dynamic_max_ngrams lookup.save_period
feedback.min_period diagnostics.period diagnostics.hardware_id
suffix.history_path suffix.history_max_tokens suffix.save_period
chat.template_path chat.conversation_cache_mb
traffic.log_path traffic.max_bytes
backend remote.url remote.model remote.api_key_env remote.connect_timeout remote.read_timeout
remote.probe_period remote.n_ctx remote.fallback
""".split()


def test_parameter_table_has_the_documented_names_and_descriptors() -> None:
    assert sorted(p.name for p in PARAMETERS) == sorted(EXPECTED_NAMES)
    for spec in PARAMETERS:
        descriptor = spec.descriptor()
        assert descriptor.description
        assert descriptor.read_only == (spec.name == "lookup.cache_dir")  # the rest: see the callback
        if spec.value_range is not None:
            assert spec.value_range[0] <= spec.default <= spec.value_range[1], spec.name
            assert descriptor.integer_range or descriptor.floating_point_range
    assert check_values(defaults(), configured=False) == ""


def test_chat_parameters_are_configure_time_and_reach_the_engine_config(tmp_path: Path) -> None:
    """chat.* is read by configure (the template is loaded with the models); the snapshot bound is
    given in MiB; a template file that does not exist fails configure before any model loads."""
    from gemma_spec_ros.engine.errors import ModelLoadError
    from gemma_spec_ros.node.engine_factory import check_files, plan_engine

    assert all(PARAMETERS_BY_NAME[name].configure_time for name in ("chat.template_path", "chat.conversation_cache_mb"))
    values = {**defaults(), "chat.template_path": str(tmp_path / "missing.jinja"), "chat.conversation_cache_mb": 64}
    config = engine_config_from(values)
    assert config.chat.conversation_cache_bytes == 64 << 20 and config.chat.template_path.endswith("missing.jinja")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # what check_files reads of a model before any load
    with pytest.raises(ModelLoadError, match="chat template file not found: .*missing.jinja"):
        check_files(plan_engine({**values, "target.model_path": str(model), "lookup.cache_dir": str(tmp_path)}))


def test_docs_parameters_md_is_generated_from_the_table(repo_root: Path) -> None:
    assert (repo_root / "docs" / "parameters.md").read_text() == render_markdown(), (
        "regenerate: python -m gemma_spec_ros.node.parameters --write docs/parameters.md")


def test_shipped_configs_give_valid_engine_configs(repo_root: Path) -> None:
    embedded = engine_config_from(config_values(repo_root, "embedded.yaml"))
    assert embedded.draft is None and embedded.target.n_gpu_layers == 0
    # n-gram lookup drafts 12 tokens a step and the adaptive policy cuts each draft: a
    # fixed K = 12 would be slower than plain decoding on many prompts of this CPU
    assert embedded.spec.mode == "lookup" and embedded.spec.draft_max == 12 and embedded.spec.adaptive
    assert embedded.target.resolved_path.endswith("gemma-3-270m-q4_k_m.gguf")
    assert "~" not in embedded.target.resolved_path
    # the suffix history lies in the folder the node owns, beside the learned n-gram cache
    assert embedded.suffix.history_path == "~/.cache/gemma_spec_ros/suffix-history.bin"
    assert embedded.suffix.cache_dir == embedded.lookup.cache_dir
    # the grammar tokenizer is built at configure, not under the first plan (its build stalls the node)
    assert embedded.prepare_grammar and not engine_config_from(defaults()).prepare_grammar

    orin = engine_config_from(config_values(repo_root, "orin.yaml"))
    assert orin.target.path == "/opt/models/gemma-3-4b-it-q4_0.gguf"
    assert orin.draft is not None and orin.draft.path == "/opt/models/gemma-3-1b-it-q4_0.gguf"
    assert orin.spec.mode == "draft" and orin.target.flash_attn
    assert orin.target.n_gpu_layers == orin.draft.n_gpu_layers == -1
    assert orin.draft.n_ctx == orin.target.n_ctx == 4096 and orin.prepare_grammar


@pytest.mark.parametrize("target, draft, expected", [
    (True, "target", True), (False, "target", False), (True, "disabled", False), (False, "enabled", True)])
def test_the_draft_has_the_targets_flash_attention_unless_told(target: bool, draft: str, expected: bool) -> None:
    values = {**defaults(), "draft.model_path": "/m/draft.gguf", "target.flash_attn": target,
              "draft.flash_attn": draft}
    config = engine_config_from(values)
    assert config.target.flash_attn == target and config.draft.flash_attn == expected


def test_the_draft_flash_attention_is_one_of_its_choices() -> None:
    assert "expected one of" in check_values({**defaults(), "draft.flash_attn": "off"}, configured=False)


@pytest.mark.parametrize("changes, reason", [
    ({"spec.mode": "draft"}, "needs a draft model"),
    ({"spec.mode": "warp"}, "expected one of"),
    ({"spec.draft_min": 9, "spec.draft_max": 4}, "draft_min=9"),
    ({"lookup.ngram_min": 3, "lookup.ngram_max": 2}, "n-gram sizes"),
    ({"generation.top_p": 0.0}, "top_p=0.0"),
    ({"generation.max_tokens": 2048}, "exceeds limits.max_tokens"),
    ({"target.model_path": ""}, "model path is empty"),
    ({"suffix.history_path": "../elsewhere.bin"}, "outside the cache folder"),
    ({"suffix.history_path": "/tmp/history.bin"}, "outside the cache folder"),
    ({"suffix.history_path": "h.bin", "lookup.cache_dir": ""}, "relative to lookup.cache_dir"),
    ({"suffix.history_path": "learned.bin", "lookup.dynamic_path": "~/.cache/gemma_spec_ros/learned.bin"},
     "are the same file"),
])
def test_inconsistent_values_are_refused_with_a_reason(changes: Dict[str, Any], reason: str) -> None:
    assert reason in check_values({**defaults(), **changes}, configured=False)


def goal(**fields: Any) -> Generate.Goal:
    return Generate.Goal(**{"prompt": "Hi", **fields})


def test_goal_defaults_come_from_the_node_parameters() -> None:
    values = {**defaults(), "generation.max_tokens": 64, "generation.top_p": 0.9, "generation.seed": 11}
    request = request_from_goal(goal(seed=-1), values)  # a message's seed defaults to 0, not -1
    assert (request.max_tokens, request.sampling.top_p, request.sampling.seed) == (64, 0.9, 11)
    assert request.spec_mode is None and request.sampling.greedy
    request = request_from_goal(goal(max_tokens=5, top_p=0.5, seed=3, temperature=0.7,
                                     spec_mode="off", stop=["\n"]), values)
    assert (request.max_tokens, request.sampling.top_p, request.sampling.seed) == (5, 0.5, 3)
    assert request.spec_mode == "off" and request.stop == ("\n",) and request.sampling.temperature == pytest.approx(0.7)
    # -1 asks for the node's temperature / top_k; a goal's own 0 stays greedy / unlimited
    values.update({"generation.temperature": 0.8, "generation.top_k": 40})
    request = request_from_goal(goal(temperature=-1.0, top_k=-1), values)
    assert (request.sampling.temperature, request.sampling.top_k) == (pytest.approx(0.8), 40)
    request = request_from_goal(goal(), values)
    assert request.sampling.greedy and request.sampling.top_k == 0


@pytest.mark.parametrize("fields, reason", [
    (dict(prompt=""), "prompt is empty"),
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_p=-0.5), "top_p=-0.5"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(spec_mode="fast"), "spec_mode 'fast'"),
    (dict(max_tokens=5000), "exceeds limits.max_tokens"),
    (dict(seed=-7), "seed=-7"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_invalid_goal_fields_are_rejected_with_a_reason(fields: Dict[str, Any], reason: str) -> None:
    with pytest.raises(GoalRejected, match=re.escape(reason)):
        request_from_goal(goal(**fields), defaults())


def stats(**fields: Any) -> SpecStats:
    s = SpecStats(spec_mode="lookup", draft_max=3, num_generated_tokens=11, num_step_tokens=10,
                  generation_time=1.0,
                  plain_token_time=0.1, time_to_first_token=0.05, predicted_speedup=1.4, **fields)
    s.observe_draft(3, 2, "lookup")
    s.observe_draft(3, 0, "lookup")
    return s


def test_spec_stats_message_is_the_dataclass_formatted() -> None:
    s = stats()
    msg = messages.spec_stats_msg(s, Time(sec=5))
    assert msg.header.stamp.sec == 5 and msg.spec_mode == "lookup" and msg.draft_max == 3
    assert (msg.num_drafts, msg.num_draft_tokens, msg.num_accepted_tokens) == (2, 6, 2)
    assert msg.mean_acceptance_length == s.mean_acceptance_length == 2.0
    assert msg.acceptance_rate == pytest.approx(1 / 3)
    assert list(msg.acceptance_per_position) == s.acceptance_per_position
    assert msg.time_to_first_token_ms == pytest.approx(50.0)
    assert msg.measured_speedup == pytest.approx(s.measured_speedup)
    assert math.isnan(messages.spec_stats_msg(SpecStats(), Time()).mean_acceptance_length)


def view(**fields: Any) -> diagnostics.NodeView:
    base = dict(node_name="gs", hardware_id="robot1", lifecycle_state="active", queue_depth=0,
                queue_max_depth=4, running=False, spec=SpecConfig(mode="lookup", draft_max=3),
                model_info={"target": {"path": "/m.gguf", "n_vocab": 262144}, "draft": None})
    return diagnostics.NodeView(**{**base, **fields})


def log_with(*finished: SpecStats, failed: bool = False) -> diagnostics.RequestLog:
    log = diagnostics.RequestLog()
    for s in finished:
        log.record("length", 1.0, s)
    if failed:
        log.record("error", 0.5, None, "rollback failed")
    return log


@pytest.mark.parametrize("node_view, log, level, message", [
    (view(lifecycle_state="inactive"), log_with(stats()), DiagnosticStatus.OK, "inactive"),
    (view(lifecycle_state="unconfigured"), log_with(), DiagnosticStatus.OK, "unconfigured"),
    (view(lifecycle_state="configuring"), log_with(), DiagnosticStatus.OK, "configuring"),
    (view(lifecycle_state="unconfigured", configure_error="cannot load /m.gguf"), log_with(),
     DiagnosticStatus.ERROR, "configure failed: cannot load /m.gguf"),
    (view(lifecycle_state="configuring", configure_error="cannot load /m.gguf"), log_with(),
     DiagnosticStatus.OK, "configuring"),
    (view(), log_with(stats(), failed=True), DiagnosticStatus.ERROR, "rollback failed"),
    (view(), log_with(stats()), DiagnosticStatus.OK, "ready"),
    (view(queue_depth=4), log_with(stats()), DiagnosticStatus.WARN, "queue backing up"),
    (view(), log_with(SpecStats(num_generated_tokens=11, num_step_tokens=10, generation_time=2.0,
                                plain_token_time=0.1, predicted_speedup=0.8)),
     DiagnosticStatus.WARN, "slower than plain"),
])
def test_status_levels(node_view: diagnostics.NodeView, log: diagnostics.RequestLog, level: bytes,
                       message: str) -> None:
    status = diagnostics.spec_status(node_view, log, None)
    assert status.level == level and message in status.message
    assert status.name == "gs: speculative decoding" and status.hardware_id == "robot1"


def test_status_key_values_and_models_status() -> None:
    log = log_with(stats(), stats())
    log.reject("queue full")
    values = diagnostics.key_values(diagnostics.spec_status(view(), log, stats()))
    assert values["tau (mean acceptance length)"] == "2" and values["K (draft_max)"] == "3"
    assert values["requests ok"] == "2" and values["requests rejected"] == "1"
    assert values["last rejection"] == "queue full" and float(values["RSS MiB"]) > 0
    assert values["latency p50 s"] == "1" and values["tokens/s"] == "10"
    models = diagnostics.models_status(view())
    assert diagnostics.key_values(models) == {"target.path": "/m.gguf", "target.n_vocab": "262144"}
    unloaded = diagnostics.models_status(view(lifecycle_state="unconfigured", model_info={}))
    assert (unloaded.level, unloaded.message) == (DiagnosticStatus.OK, "no models loaded")
    failed = diagnostics.models_status(view(lifecycle_state="unconfigured", model_info={},
                                            configure_error="cannot load /m.gguf"))
    assert failed.level == DiagnosticStatus.ERROR and "cannot load /m.gguf" in failed.message


class GoalHandle:
    """Stand-in for rclpy's ServerGoalHandle, which only an action server can create. It lets a
    test flip ``is_cancel_requested`` at a chosen moment: rclpy sets it just *after* the cancel
    callback, and the queue must wait for it (the real sequence is in node/test_inprocess.py)."""

    def __init__(self, i: int) -> None:
        self.goal_id = SimpleNamespace(uuid=[i])
        self.is_cancel_requested = False


def test_job_queue_counts_waiting_goals_not_the_running_one() -> None:
    queue = goals.JobQueue()
    handles = [GoalHandle(i) for i in range(3)]
    jobs = [goals.Job(h, None) for h in handles]
    queue.push(jobs[0])
    assert queue.depth() == 0, "the next goal to run is not waiting"
    assert queue.next_to_start() is jobs[0] and queue.is_running(jobs[0])
    queue.push(jobs[1])
    queue.push(jobs[2])
    assert queue.depth() == 2
    queue.drop_all("deactivated")
    assert jobs[0].cancel.is_set() and queue.next_to_start() is jobs[1], "dropped goals start at once"
    queue.finished(jobs[0])
    assert queue.next_to_start() is jobs[2]
    queue.close()
    assert queue.next_to_start() is None


def test_a_goal_queued_after_a_transition_stopped_goals_is_dropped_until_resumed() -> None:
    """L5 (first review): the goal callback's check of `accepting` and the push were not atomic,
    so a goal accepted as deactivate began was queued after drop_all and then served while the node
    was inactive. The queue itself now drops what is pushed after drop_all, until resume()."""
    queue = goals.JobQueue()
    queue.drop_all("the node was deactivated")
    late = goals.Job(GoalHandle(7), None)
    queue.push(late)
    assert late.drop_reason == "the node was deactivated" and late.cancel.is_set()
    assert queue.next_to_start() is late  # ends at once, unstarted
    queue.finished(late)
    queue.resume()
    served = goals.Job(GoalHandle(8), None)
    queue.push(served)
    assert not served.drop_reason and queue.next_to_start() is served and queue.is_running(served)


@pytest.mark.parametrize("module", [messages, diagnostics, serve])  # parameters.py has no examples
def test_docstring_examples(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_job_queue_hands_out_a_cancelled_waiting_goal_once_rclpy_reports_the_cancel() -> None:
    """A cancel accepted for a waiting goal: next_to_start polls until the goal handle says
    is_cancel_requested (so the goal can end CANCELED), then hands it out before the FIFO order."""
    queue = goals.JobQueue()
    handles = [GoalHandle(i) for i in range(3)]
    jobs = [goals.Job(h, None) for h in handles]
    for job in jobs:
        queue.push(job)
    assert queue.next_to_start() is jobs[0]  # running
    assert queue.cancel(jobs[2].key)
    picked: list = []
    waiter = threading.Thread(target=lambda: picked.append(queue.next_to_start(poll=0.005)), daemon=True)
    try:
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not picked, "handed out before rclpy reported the cancel"
        handles[2].is_cancel_requested = True  # what rclpy does right after the cancel callback
        waiter.join(5.0)
        assert picked == [jobs[2]], "the cancelled goal must not wait behind the running one"
        queue.finished(jobs[0])
        assert queue.next_to_start() is jobs[1]
    finally:
        queue.close()


@dataclass(frozen=True)
class _Toy:
    """A config of a new part: its settings are fields with their parameter metadata."""

    speed: float = param(0.5, "how fast the toy goes", (0.0, 2.0))
    colour: str = param("red", "the toy's colour", choices=("red", "blue"))
    blocks_kib: int = param(4 << 10, "memory for blocks (KiB)", (0, 64), name="blocks_mib", scale=1 << 10)
    internal: int = param(3, "", (1, 5), node=False)

    def __post_init__(self) -> None:
        check_params(self)


def test_a_config_field_is_a_parameter_row_a_doc_line_and_a_built_config() -> None:
    """One field with its metadata: a row of the table (name, default in the parameter's unit,
    range, choices), a line of docs/parameters.md, its value in the config built from parameter
    values, and its range checked where the config is made."""
    rows = rows_of(_Toy, "toy")
    assert [r.name for r in rows] == ["toy.speed", "toy.colour", "toy.blocks_mib"]
    assert rows[2].default == 4 and rows[2].value_range == (0, 64) and rows[1].choices == ("red", "blue")
    page = render_markdown(rows)
    assert "| `toy.speed` | float | `0.5` | [0.0, 2.0] | how fast the toy goes |" in page
    built = config_of(_Toy, "toy", {"toy.speed": 1.5, "toy.colour": "blue", "toy.blocks_mib": 2})
    assert (built.speed, built.colour, built.blocks_kib, built.internal) == (1.5, "blue", 2048, 3)
    with pytest.raises(ValueError, match=r"blocks_mib=65.0: must be in \[0, 64\]"):
        config_of(_Toy, "toy", {"toy.speed": 1.0, "toy.colour": "red", "toy.blocks_mib": 65})
    with pytest.raises(ValueError, match="expected one of red, blue"):
        _Toy(colour="green")


def test_configure_time_groups_are_one_list() -> None:
    """queue.result_timeout is read by configure only: it is configure-time (a runtime set was
    accepted and silently did nothing), and the doc's list of configure-time groups is that list."""
    assert PARAMETERS_BY_NAME["queue.result_timeout"].configure_time
    assert "`queue.result_timeout`" in render_markdown()
