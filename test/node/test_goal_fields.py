"""Goal fields, telemetry topics and parameter effects of the node, on a tiny GGUF pair.

Real rclpy over loopback DDS and real llama.cpp, on tiny random-weight F32 models (test/support/tiny_gguf.py):
they load and generate in milliseconds, their logits do not depend on the batch, and the GGUF has
no chat template. So the node's text can be compared token for token with an Engine in this process
built from the same parameters (exact verification is lossless whatever the drafts).

One node serves the module, active; a test that changes a parameter or the state restores it
itself, so any test runs alone (``-k``) or in any order.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator

import pytest
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus

from gemma_spec_ros.client import GenerateClient, key_values, wait_until
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import SamplingParams
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.parameters import defaults, engine_config_from
from support.engine import collect
from support.node import ServedNode, greedy_goal
from support.tiny_gguf import tokenize, write_tiny_pair

NODE = "gemma_spec_goal_fields"
SPEC_STATUS = spec_status_name(NODE)
PROMPT = "the robot"
K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_pair(tmp_path_factory.mktemp("tiny_node"))


@pytest.fixture(scope="module")
def values(pair) -> Dict[str, Any]:
    target, draft = pair
    return {**defaults(), "target.model_path": str(target), "target.n_ctx": 256, "target.n_threads": 1,
            "draft.model_path": str(draft), "draft.n_threads": 1, "spec.mode": "draft",
            "spec.draft_max": K, "spec.adaptive": False, "spec.p_min": 0.0,
            "generation.max_tokens": 16, "limits.max_tokens": 200, "limits.max_prompt_tokens": 200,
            "diagnostics.period": 0.2}


@pytest.fixture(scope="module")
def client(node_client: Callable[..., ServedNode], values: Dict[str, Any]) -> GenerateClient:
    return node_client(NODE, {name: value for name, value in values.items() if value != defaults()[name]}).client


@pytest.fixture(scope="module")
def reference(values: Dict[str, Any]) -> Iterator[Engine]:
    """The engine the node runs, in this process (mode off: the text is the same in every mode)."""
    engine = Engine(engine_config_from({**values, "spec.mode": "off"}), calibrate=False)
    yield engine
    engine.close()


def reference_text(engine: Engine, **request: Any) -> str:
    return collect(engine, GenerationRequest(**request)).text


@contextmanager
def parameters(client: GenerateClient, base: Dict[str, Any], **changed: Any) -> Iterator[None]:
    """Set parameters (dots written '__') for the block, then put back their ``base`` values."""
    results = client.set_parameters(**changed)
    assert all(r.successful for r in results), [r.reason for r in results]
    try:
        yield
    finally:
        restore = {name: base[name.replace("__", ".")] for name in changed}
        assert all(r.successful for r in client.set_parameters(**restore))


def goal(**fields: Any) -> Dict[str, Any]:
    return {**greedy_goal(PROMPT, 24, seed=1), **fields}


def test_chat_template_on_a_model_without_one_is_rejected_and_the_node_keeps_serving(
        client: GenerateClient) -> None:
    """The tiny GGUF has no chat template: a goal asking for it is rejected with the reason (it
    must not take the node's executor down), and the next goal is served."""
    mark = client.log_mark()
    run = client.send(**goal(use_chat_template=True, system_prompt="Be brief."))
    assert not run.accepted
    assert "has no chat template" in client.wait_log("goal rejected", since=mark).msg
    status = client.wait_status(SPEC_STATUS, lambda s: "chat template" in key_values(s)["last rejection"])
    assert status.level != DiagnosticStatus.ERROR
    after = client.send(**goal(max_tokens=4))
    assert after.accepted and after.wait_result().finish_reason == "length"


def test_system_prompt_without_template_leads_the_prompt(client: GenerateClient, reference: Engine,
                                                         pair) -> None:
    run = client.send(**goal(system_prompt="be brief."))
    result = run.wait_result()
    assert result.prompt_tokens == len(tokenize(pair[0], "be brief.\n\n" + PROMPT))
    assert result.text == reference_text(reference, prompt=PROMPT, system_prompt="be brief.",
                                         max_tokens=24)
    assert result.text != reference_text(reference, prompt=PROMPT, max_tokens=24)


def test_stop_strings_and_eos_through_goals(client: GenerateClient, reference: Engine) -> None:
    full = reference_text(reference, prompt=PROMPT, max_tokens=60)
    stops = [full[30:33], full[12:15], "#never#"]
    cut = min(full.find(s) for s in stops[:2])
    run = client.send(**goal(max_tokens=60, stop=stops))
    result = run.wait_result()
    assert result.finish_reason == "stop" and result.text == full[:cut]
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    # EOS: sampled sequences of the tiny model end with it long before 200 tokens
    finished = []
    for seed in range(4):
        fields = goal(max_tokens=200, temperature=1.0, seed=seed)
        result = client.send(**fields).wait_result()
        expected = reference_text(reference, prompt=PROMPT, max_tokens=200,
                                  sampling=SamplingParams(temperature=1.0, seed=seed))
        assert result.text == expected
        finished.append((result.finish_reason, result.completion_tokens))
    assert any(reason == "stop" and n < 200 for reason, n in finished), finished


def test_feedback_after_the_result_still_reaches_the_run(client: GenerateClient) -> None:
    """The result (a service response) can overtake the goal's last feedback (a topic); rclpy's
    ActionClient forgets a goal's feedback callback once the result is in, so that text was lost
    (test_stop_strings_and_eos_through_goals failed now and then). GenerateClient listens to the
    feedback topic itself. Made deterministic here: a feedback message for the goal is published
    (by a test publisher, the same topic and type as the node's) after the result came."""
    from gemma_spec_msgs.action import Generate
    from rclpy.qos import QoSProfile

    from gemma_spec_ros.node import action_name
    run = client.send(**goal(max_tokens=8))
    result = run.wait_result()
    publisher = client.node.create_publisher(Generate.Impl.FeedbackMessage,
                                             f"{action_name(NODE)}/_action/feedback", QoSProfile(depth=10))
    try:
        late = Generate.Impl.FeedbackMessage(goal_id=run.handle.goal_id)
        late.feedback.text = "#late#"
        wait_until(lambda: publisher.get_subscription_count() >= 1, 10.0, "the feedback subscription")
        publisher.publish(late)
        wait_until(lambda: any(f.text == "#late#" for f in run.feedback), 10.0, "the late feedback message")
    finally:
        client.node.destroy_publisher(publisher)
    # and the node's own feedback, some of which may also have come after the result: all the text
    wait_until(lambda: "".join(f.text for f in run.feedback if f.text != "#late#") == result.text, 5.0,
               "all text streamed as feedback")


def test_generation_defaults_reach_the_engine(client: GenerateClient, reference: Engine, values: Dict[str, Any]) -> None:
    """temperature -1, top_k -1, seed -1, max_tokens 0, top_p 0 take the node's generation.*."""
    fields = goal(temperature=-1.0, top_k=-1, seed=-1, max_tokens=0, top_p=0.0)
    with parameters(client, values, generation__temperature=0.9, generation__top_k=5, generation__seed=42,
                    generation__max_tokens=20, generation__top_p=0.8):
        result = client.send(**fields).wait_result()
        zero = client.send(**goal(temperature=0.0, top_k=0, seed=3)).wait_result()
    sampling = SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=42)
    assert result.text == reference_text(reference, prompt=PROMPT, max_tokens=20, sampling=sampling)
    assert result.completion_tokens == 20 or result.finish_reason == "stop"
    for other in (replace(sampling, temperature=1.0), replace(sampling, top_k=0),
                  replace(sampling, seed=43), replace(sampling, top_p=1.0)):
        if reference_text(reference, prompt=PROMPT, max_tokens=20, sampling=other) != result.text:
            continue
        pytest.fail(f"{other} gives the same text: the check of {sampling} would be vacuous")
    # a goal's own 0 stays greedy whatever generation.temperature says
    assert zero.text == reference_text(reference, prompt=PROMPT, max_tokens=24)


def test_seed_minus_one_gives_different_outputs(client: GenerateClient) -> None:
    texts = {client.send(**goal(temperature=1.0, seed=-1)).wait_result().text for _ in range(3)}
    assert len(texts) > 1
    fixed = {client.send(**goal(temperature=1.0, seed=9)).wait_result().text for _ in range(2)}
    assert len(fixed) == 1


def test_rejection_verification_selected_by_the_parameter(client: GenerateClient, reference: Engine, values: Dict[str, Any]) -> None:
    """spec.verification=rejection (Leviathan/Chen) gives other tokens than exact verification for
    the same seed (it uses the randomness differently): the node's text is the rejection engine's."""
    def texts(seed: int) -> Dict[str, str]:
        out = {}
        for verification in ("exact", "rejection"):
            reference.update_spec(replace(reference.spec, verification=verification, mode="draft"))
            out[verification] = reference_text(
                reference, prompt=PROMPT, max_tokens=24,
                sampling=SamplingParams(temperature=1.0, seed=seed))
        reference.update_spec(replace(reference.spec, verification="exact", mode="off"))
        return out

    seed = next(s for s in range(20) if len(set(texts(s).values())) == 2)
    expected = texts(seed)
    with parameters(client, values, spec__verification="rejection"):
        result = client.send(**goal(temperature=1.0, seed=seed)).wait_result()
    assert result.stats.verification == "rejection" and result.stats.num_drafts > 0
    assert result.text == expected["rejection"] != expected["exact"]


def test_spec_stats_topics_carry_each_request_and_the_lifetime(client: GenerateClient) -> None:
    """~/spec_stats: one message per finished request, equal to the result's stats;
    ~/spec_stats_rolling: the lifetime stats every diagnostics.period, grown by the request."""
    client.wait_subscribed()
    wait_until(lambda: client.spec_stats_rolling, 10.0, "a rolling stats message")
    seen = len(client.spec_stats)
    before = client.spec_stats_rolling[-1]
    result = client.send(**goal(max_tokens=30)).wait_result()
    message = wait_until(lambda: client.spec_stats[seen:], 10.0, "a spec_stats message")[-1]
    stats = result.stats
    assert len(client.spec_stats) == seen + 1
    for field in ("spec_mode", "verification", "draft_max", "draft_last", "num_drafts",
                  "num_draft_tokens", "num_accepted_tokens", "num_generated_tokens", "num_steps",
                  "acceptance_rate", "mean_acceptance_length", "tokens_per_second",
                  "time_to_first_token_ms", "measured_speedup"):
        assert getattr(message, field) == getattr(stats, field), field
    assert list(message.acceptance_per_position) == list(stats.acceptance_per_position)
    assert message.num_generated_tokens == 30 and message.num_drafts > 0
    assert message.spec_mode == "draft" and message.draft_max == K
    assert message.header.stamp.sec > 0 and 0 <= message.acceptance_rate <= 1
    assert message.mean_acceptance_length == pytest.approx(
        1 + message.num_accepted_tokens / message.num_drafts)

    def grown() -> Any:
        latest = client.spec_stats_rolling[-1]
        return latest if latest.num_generated_tokens >= before.num_generated_tokens + 30 else None

    rolling = wait_until(grown, 10.0, "rolling stats that include the request")
    assert rolling.num_drafts >= before.num_drafts + stats.num_drafts
    assert rolling.header.stamp.sec > 0 and not math.isnan(rolling.mean_acceptance_length)


def test_diagnostics_warn_when_speculation_is_slower_and_off_never_warns(client: GenerateClient, values: Dict[str, Any]) -> None:
    """A workload built to be slow: 8-token drafts of a draft model that disagrees with the target
    (random weights) cost 8 draft passes and a 9-row verify for about one token. The node's
    status turns WARN naming it; with spec.mode off the same history never warns."""
    with parameters(client, values, spec__draft_max=8):
        for _ in range(2):
            assert client.send(**goal(max_tokens=40)).wait_result().stats.num_drafts > 0
        warn = client.wait_status(SPEC_STATUS, lambda s: s.level == DiagnosticStatus.WARN)
        assert "slower than plain decoding" in warn.message, warn.message
        with parameters(client, values, spec__mode="off"):
            ok = client.wait_status(SPEC_STATUS, lambda s: key_values(s)["mode"] == "off")
            assert ok.level == DiagnosticStatus.OK, ok.message


def test_feedback_min_period_spaces_the_messages_and_keeps_all_text(client: GenerateClient, values: Dict[str, Any]) -> None:
    """feedback.min_period 0.05 s: at most one message per period (plus the first and the last),
    far fewer than the steps, with every piece of text carried."""
    with parameters(client, values, feedback__min_period=0.05, spec__mode="off"):
        started = time.monotonic()
        run = client.send(**goal(max_tokens=200, stop=[]))
        result = run.wait_result()
        elapsed = time.monotonic() - started
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    steps = result.stats.num_steps + 1
    assert steps == result.completion_tokens or result.finish_reason == "stop"
    assert 2 <= len(run.feedback) <= elapsed / 0.05 + 2, (len(run.feedback), elapsed)
    assert len(run.feedback) < steps or steps <= 2
    assert run.feedback[-1].completion_tokens == result.completion_tokens


def test_constrained_goals_follow_their_grammar_or_schema(client: GenerateClient, reference: Engine,
                                                           values: Dict[str, Any]) -> None:
    """A goal's json_schema or grammar reaches the engine: the text is the reference engine's
    constrained text (the tiny vocabulary spells lowercase words, so a boolean schema and a
    two-word grammar), and the node's generation.json_schema applies to goals that set none."""
    for fields in ({"json_schema": '{"type": "boolean"}'}, {"grammar": 'root ::= "go" | "stop"'}):
        result = client.send(**goal(max_tokens=16, **fields)).wait_result()
        assert result.finish_reason == "stop", result
        assert result.text.strip() in ("true", "false", "go", "stop"), result.text
        assert result.text == reference_text(reference, prompt=PROMPT, max_tokens=16, **fields)
    with parameters(client, values, generation__json_schema='{"enum": ["yes", "no"]}'):
        result = client.send(**goal(max_tokens=16)).wait_result()
    # an enum of strings needs '"', which the tiny vocabulary cannot spell: the request ends with
    # the grammar's reason (and shows the default reached the engine)
    assert result.finish_reason == "error" and "the grammar refused" in result.error, result


def test_constraint_refusals_name_the_reason_and_the_node_keeps_serving(client: GenerateClient) -> None:
    cases = [
        ({"grammar": 'root ::= "a" | nowhere'}, "rule 'nowhere' is used but not defined"),
        ({"grammar": 'root ::= "a"', "json_schema": '{"type": "boolean"}'}, "at most one"),
        ({"json_schema": "{nope"}, "json_schema is not valid JSON"),
        ({"json_schema": '{"type": "string", "pattern": "(?=a)"}'}, "look-around"),
        ({"grammar": 'root ::= "' + "a" * 70_000 + '"'}, "limits.max_grammar_bytes"),
    ]
    for fields, reason in cases:
        mark = client.log_mark()
        run = client.send(**goal(**fields))
        assert not run.accepted, fields
        assert reason in client.wait_log("goal rejected", since=mark).msg, fields
    # the length of a constrained text that max_tokens cut is said in the result's error
    result = client.send(**goal(max_tokens=1, grammar='root ::= "stop"')).wait_result()
    assert result.finish_reason == "length" and "not a whole match" in result.error, result
    assert client.send(**goal(max_tokens=4)).wait_result().finish_reason == "length"
