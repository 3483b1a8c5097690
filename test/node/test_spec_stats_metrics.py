"""vLLM's per-request acceptance summary on the node's topics: the acceptance histogram, the tokens
drafted and accepted by source, the grammar's rows without logits and cut tokens.

A real node (rclpy over loopback DDS) on the tiny GGUF pair (test/support/tiny_gguf.py), ``draft+lookup``
with K fixed: a plain goal (the draft model and lookup draft) and a constrained one (the grammar
forces most of its text). Each finished goal's ``~/spec_stats`` message carries the new fields,
equal to the goal's result stats and consistent with each other; ``ros2 topic echo`` prints them
(its YAML formatter); rqt_plot resolves the scalar fields and the histogram's cells; /diagnostics
shows them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import pytest

from gemma_spec_ros.client import GenerateClient, key_values, wait_until
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.parameters import defaults
from support.node import ServedNode, greedy_goal
from support.tiny_gguf import write_tiny_pair

NODE = "gemma_spec_acceptance_metrics"
K = 4
KINDS = ("lookup", "suffix", "model", "grammar")
NEW_SCALARS = tuple(f"num_{kind}_{what}_tokens" for kind in KINDS for what in ("draft", "accepted")) + (
    "num_grammar_cut_tokens", "num_grammar_sole_rows")
GRAMMAR = 'root ::= (("go" | "stop") " " ("left" | "right") ". ")+'


@pytest.fixture(scope="module")
def client(node_client: Callable[..., ServedNode], tmp_path_factory: pytest.TempPathFactory) -> GenerateClient:
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("tiny_metrics"))
    values: Dict[str, Any] = {
        "target.model_path": str(target), "target.n_ctx": 256, "target.n_threads": 1,
        "draft.model_path": str(draft), "draft.n_threads": 1, "spec.mode": "draft+lookup",
        "spec.draft_max": K, "spec.adaptive": False, "spec.p_min": 0.0, "generation.max_tokens": 16,
        "limits.max_tokens": 200, "limits.max_prompt_tokens": 200, "diagnostics.period": 0.2}
    return node_client(NODE, {k: v for k, v in values.items() if v != defaults()[k]}).client


def published(client: GenerateClient, **goal: Any) -> Any:
    """The goal's result and the ~/spec_stats message its end published."""
    client.wait_subscribed()
    seen = len(client.spec_stats)
    result = client.send(**greedy_goal("the robot the robot", 40, **goal)).wait_result()
    message = wait_until(lambda: client.spec_stats[seen:], 10.0, "a spec_stats message")[-1]
    return result, message


def check_summary(message: Any) -> None:
    h = list(message.acceptance_histogram)
    assert sum(h) == message.num_drafts > 0
    assert sum(i * n for i, n in enumerate(h)) == message.num_accepted_tokens
    assert len(h) == len(message.acceptance_per_position) + 1  # 0..the longest draft
    assert sum(getattr(message, f"num_{kind}_draft_tokens") for kind in KINDS) == message.num_draft_tokens
    assert sum(getattr(message, f"num_{kind}_accepted_tokens") for kind in KINDS) == message.num_accepted_tokens
    assert message.mean_acceptance_length == pytest.approx(1 + message.num_accepted_tokens / message.num_drafts)


@pytest.mark.timeout(120)
def test_spec_stats_carry_the_histogram_and_the_tokens_by_source(client: GenerateClient) -> None:
    plain, plain_message = published(client)
    constrained, constrained_message = published(client, grammar=GRAMMAR)
    for result, message in ((plain, plain_message), (constrained, constrained_message)):
        assert result.finish_reason == "length"
        for field in NEW_SCALARS + ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert getattr(message, field) == getattr(result.stats, field), field
        assert list(message.acceptance_histogram) == list(result.stats.acceptance_histogram)
        check_summary(message)
    assert plain_message.num_model_draft_tokens > 0  # the draft model drafts at every step lookup does not
    assert plain_message.num_grammar_draft_tokens == plain_message.num_grammar_sole_rows == 0
    assert constrained_message.num_grammar_draft_tokens > 0 and constrained_message.num_grammar_sole_rows > 0
    assert constrained_message.spec_mode == plain_message.spec_mode == "draft+lookup"


def test_topic_echo_prints_the_new_fields(client: GenerateClient) -> None:
    """``ros2 topic echo`` prints a message with rosidl_runtime_py's YAML formatter (ros2-tools)."""
    echo = pytest.importorskip("rosidl_runtime_py", reason="rosidl_runtime_py comes with ros2-tools, which .ci/run installs")
    _, message = published(client)
    echoed = echo.message_to_yaml(message)
    for field in NEW_SCALARS + ("acceptance_histogram",):
        assert f"\n{field}:" in echoed, field


def test_rqt_plot_resolves_the_new_fields(client: GenerateClient) -> None:
    """rqt_plot plots a scalar field or an array's cell (``field[i]``); the histogram as a whole
    is not plottable (rqt_plot's own rule), its cells are."""
    plot_widget = pytest.importorskip("rqt_plot.plot_widget")
    topic = f"/{NODE}/spec_stats"
    wait_until(lambda: any(name == topic for name, _ in client.node.get_topic_names_and_types()), 10.0,
               "the spec_stats topic discovered")
    for path in NEW_SCALARS + ("acceptance_histogram[0]", "acceptance_histogram[4]"):
        fields, why = plot_widget.get_plot_fields(client.node, f"{topic}/{path}")
        assert fields == [f"{topic}/{path}"], (path, why)
    fields, why = plot_widget.get_plot_fields(client.node, f"{topic}/acceptance_histogram")
    assert fields == [] and "no index" in why


def test_diagnostics_show_the_histogram_and_the_tokens_by_source(client: GenerateClient) -> None:
    published(client, grammar=GRAMMAR)
    rolling = wait_until(lambda: client.spec_stats_rolling and client.spec_stats_rolling[-1].num_grammar_sole_rows
                         and client.spec_stats_rolling[-1], 10.0, "rolling stats after a constrained goal")
    status = client.wait_status(spec_status_name(NODE),
                                lambda s: key_values(s).get("grammar rows without logits", "0") != "0")
    values = key_values(status)
    histogram = [int(n) for n in values["acceptance histogram"].strip("[]").split(",")]
    assert sum(histogram) > 0 and len(histogram) >= 2
    for kind in KINDS:
        drafted, accepted = (int(n) for n in values[f"{kind} tokens drafted / accepted"].split(" / "))
        assert 0 <= accepted <= drafted
    assert int(values["grammar rows without logits"]) > 0 and int(values["grammar cut tokens"]) >= 0
    assert rolling.num_grammar_sole_rows > 0
