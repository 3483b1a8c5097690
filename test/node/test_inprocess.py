"""The gemma_spec node on real rclpy, driven by another node over the standard interfaces.

One node (real Engine on the embedded model) serves the module. The fixture configures and
activates it; every test starts from an active node (the autouse fixture brings it back there if a
test before it failed halfway) and restores what it changes (state, parameters) itself, so each test
runs alone (``-k``) or in any order. The configure-failure test takes the node down to unconfigured
and up again; the finalize test has a node of its own (finalized is final).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticStatus

from gemma_spec_ros.client import GenerateClient, collect, key_values, wait_until
from gemma_spec_ros.engine.drafters import learned_cache
from gemma_spec_ros.engine.errors import KVCacheError
from gemma_spec_ros.node import spec_status_name
from gemma_spec_ros.node.node import GemmaSpecNode
from support.node import ServedNode, greedy_goal, node_factory
from support.tiny_gguf import tokenize

NODE = "gemma_spec_inprocess"
SPEC_STATUS = spec_status_name(NODE)
MODELS_STATUS = f"{NODE}: models"
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
MISSING = "/nonexistent/gemma_spec_test/missing-model.gguf"
QUEUE_DEPTH = 2
K = 3
LONG = 400  # tokens of a goal that must outlast a few round trips (limits.max_tokens)


def overrides(model: Path, dynamic_path: Path) -> Dict[str, Any]:
    return {
        "target.model_path": str(model), "target.n_ctx": 512, "target.n_threads": 1,
        "lookup.dynamic_path": str(dynamic_path), "lookup.cache_dir": str(dynamic_path.parent),
        # adaptive off: always draft K when the n-gram caches have a continuation, so tau is known
        "spec.mode": "lookup", "spec.draft_max": K, "spec.adaptive": False, "generation.max_tokens": 8,
        "limits.max_tokens": LONG, "limits.max_prompt_tokens": 256, "queue.max_depth": QUEUE_DEPTH,
        "diagnostics.period": 0.2,
    }


@pytest.fixture(scope="module")
def served(node_client: Callable[..., ServedNode], embedded_model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> ServedNode:
    """The node under test and its client (the ``active`` fixture configures and activates it)."""
    dynamic = tmp_path_factory.mktemp("lookup") / "dynamic.bin"
    return node_client(NODE, overrides(embedded_model_path, dynamic), activate=False)


def bring_up(client: GenerateClient) -> None:
    """unconfigured/inactive -> active."""
    state = client.state()
    if state == "unconfigured":
        assert client.transition("configure") is True, "configure failed"
        state = client.state()
    if state == "inactive":
        assert client.transition("activate") is True
    assert client.state() == "active"


@pytest.fixture(autouse=True)
def active(request: pytest.FixtureRequest) -> None:
    """Every test of the shared node starts from active (whatever a failed test left)."""
    if "client" in request.fixturenames:
        bring_up(request.getfixturevalue("client"))


def long_goal(max_tokens: int = LONG) -> dict:
    return greedy_goal(PROMPT, max_tokens, seed=1)


@pytest.mark.timeout(300)
def test_configure_fails_on_bad_models_then_recovers(client: GenerateClient, embedded_model_path: Path,
                                                     other_vocab_model_path: Path) -> None:
    """active -> unconfigured; configure FAILS naming the file (missing target; draft of another
    vocabulary); the paths are fixed with set_parameters; the node configures (inactive), rejects
    goals while inactive, and activates."""
    assert client.transition("deactivate") and client.transition("cleanup")
    assert client.state() == "unconfigured"
    try:
        [result] = client.set_parameters(target__model_path=MISSING)
        assert result.successful, result.reason
        mark = client.log_mark()
        assert client.transition("configure") is False
        assert client.state() == "unconfigured"
        client.wait_log(MISSING, since=mark)
        failed = client.wait_status(SPEC_STATUS, lambda s: MISSING in s.message)
        assert failed.level == DiagnosticStatus.ERROR and failed.message.startswith("configure failed")

        results = client.set_parameters(target__model_path=str(embedded_model_path),
                                        draft__model_path=str(other_vocab_model_path))
        assert all(r.successful for r in results), results
        mark = client.log_mark()
        assert client.transition("configure") is False
        assert str(other_vocab_model_path) in client.wait_log("cannot draft for target", since=mark).msg
        assert client.state() == "unconfigured"
    finally:
        client.set_parameters(target__model_path=str(embedded_model_path), draft__model_path="")
    assert client.transition("configure") is True
    assert client.state() == "inactive"
    models = key_values(client.wait_status(MODELS_STATUS))
    assert models["target.path"] == str(embedded_model_path)
    assert models["target.n_vocab"] == "262144"
    assert models["target.size_bytes"] == str(embedded_model_path.stat().st_size)

    mark = client.log_mark()
    run = client.send(**long_goal(8))
    assert not run.accepted, "an inactive node must reject goals"
    client.wait_log("goal rejected: the node is inactive", since=mark)

    assert client.transition("activate") is True
    assert client.state() == "active"


@pytest.mark.timeout(300)
def test_a_peer_cannot_aim_the_learned_cache_at_a_file_of_its_choice(node: GemmaSpecNode,
                                                                      client: GenerateClient) -> None:
    """N2 (second review): a peer that set lookup.dynamic_path while the node was unconfigured got
    any file renamed and then overwritten with the cache. Now: a path outside lookup.cache_dir is
    refused at once, cache_dir itself is read-only, and a file inside it that the node did not
    write fails configure with a reason, untouched (no rename, no .corrupt file)."""
    own = Path(node.get_parameter("lookup.dynamic_path").value)
    victim = own.parent / "authorized_keys"
    victim.write_bytes(b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 robot@arm\n")
    before = sorted(p.name for p in own.parent.iterdir())
    assert client.transition("deactivate") and client.transition("cleanup")
    try:
        [outside] = client.set_parameters(lookup__dynamic_path="/tmp/elsewhere.bin")
        assert not outside.successful and "outside lookup.cache_dir" in outside.reason
        [folder] = client.set_parameters(lookup__cache_dir="/")
        assert not folder.successful and "read-only" in folder.reason
        [inside] = client.set_parameters(lookup__dynamic_path=str(victim))
        assert inside.successful, inside.reason
        mark = client.log_mark()
        assert client.transition("configure") is False
        assert "not a learned n-gram cache" in client.wait_log(str(victim), since=mark).msg
        assert victim.read_bytes() == b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 robot@arm\n"
        assert sorted(p.name for p in own.parent.iterdir()) == before
    finally:
        client.set_parameters(lookup__dynamic_path=str(own))
        victim.unlink()


@pytest.mark.timeout(120)
def test_invalid_goals_rejected_then_valid_goal_served(client: GenerateClient) -> None:
    """active: each invalid field is rejected (the reason is logged); a valid goal still works."""
    invalid = {
        "empty prompt": (dict(prompt=""), "prompt is empty"),
        "negative temperature": (dict(temperature=-0.5), "temperature=-0.5"),
        "NaN temperature": (dict(temperature=math.nan), "temperature=nan"),
        "negative top_p": (dict(top_p=-0.1), "top_p=-0.1"),
        "top_p above 1": (dict(top_p=1.5), "top_p=1.5"),
        "NaN top_p": (dict(top_p=math.nan), "top_p=nan"),
        "negative top_k": (dict(top_k=-2), "top_k=-2"),
        "unknown spec_mode": (dict(spec_mode="warp"), "spec_mode 'warp'"),
        "draft mode without a draft model": (dict(spec_mode="draft"), "needs a draft model"),
        "max_tokens above the cap": (dict(max_tokens=LONG + 1), f"exceeds limits.max_tokens={LONG}"),
        "prompt over max_prompt_tokens": (dict(prompt="robot " * 300), "limits.max_prompt_tokens=256"),
        "prompt + max_tokens over n_ctx": (dict(prompt="robot " * 200, max_tokens=LONG),
                                           "exceeds the context"),
    }
    for what, (fields, reason) in invalid.items():
        goal = {"prompt": "Hello", "max_tokens": 4, **fields}
        mark = client.log_mark()
        assert not client.send(**goal).accepted, f"{what} was accepted"
        client.wait_log(reason, since=mark)

    run = client.send(prompt="The robot picked up the", max_tokens=6, seed=3)
    assert run.accepted
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_SUCCEEDED
    assert result.finish_reason == "length" and result.completion_tokens == 6
    assert result.text and result.spec_mode == "lookup" and result.stats.num_generated_tokens == 6
    assert result.prompt_tokens > 5


@pytest.mark.timeout(120)
def test_stream_then_cancel_within_one_step(client: GenerateClient) -> None:
    """active: feedback streams whole text; a cancel ends the goal at a step boundary.

    Not bounded by wall-clock (a cancel over DDS on a busy machine may take any number of steps to
    arrive); what the engine guarantees is checked: the goal ends CANCELED long before its
    max_tokens, and the last step (the one that saw the cancel) emitted at most K + 1 tokens."""
    run = client.send(**long_goal())
    assert run.accepted
    run.wait_feedback(2)
    assert client.cancel(run).return_code == 0  # ERROR_NONE: the cancel was accepted
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_CANCELED
    assert result.finish_reason == "cancelled" and result.completion_tokens < LONG
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    last, before = run.feedback[-1], run.feedback[-2]
    assert last.completion_tokens == result.completion_tokens
    assert 0 <= last.completion_tokens - before.completion_tokens <= K + 1


@pytest.mark.timeout(180)
def test_queue_of_depth_n_rejects_the_n_plus_first(client: GenerateClient) -> None:
    """active: while one goal runs, N goals wait and the N+1st is rejected (queue full)."""
    running = client.send(**long_goal())
    running.wait_feedback(1)
    mark = client.log_mark()
    queued = [client.send(prompt=f"Robot number {i} is", max_tokens=2) for i in range(QUEUE_DEPTH + 1)]
    assert [run.accepted for run in queued] == [True] * QUEUE_DEPTH + [False]
    client.wait_log(f"queue full: {QUEUE_DEPTH} goals waiting", since=mark)
    # A waiting goal's cancel does not wait for the running goal.
    client.cancel(queued[0])
    assert queued[0].wait_result().finish_reason == "cancelled"
    assert queued[0].status == GoalStatus.STATUS_CANCELED
    assert not running._result_future.done(), "the running goal ended first: the check is vacuous"
    client.cancel(running)
    assert running.wait_result().finish_reason == "cancelled"
    assert collect(queued[1:QUEUE_DEPTH]) == [(True, "length")] * (QUEUE_DEPTH - 1)


@pytest.mark.timeout(180)
def test_spec_mode_and_k_switch_during_stream(client: GenerateClient) -> None:
    """active: spec.mode and spec.draft_max set through ~/set_parameters while a goal streams show
    in the following feedback and the result, and K is *used*: after the switch to K = 1 no step
    emits more than 2 tokens (before it, lookup on this code drafts 3 and steps emit up to 4).
    Invalid values are refused with a reason."""
    try:
        run = client.send(**long_goal(200))
        assert run.wait_feedback(1).spec_mode == "lookup"
        wait_until(lambda: any(b.completion_tokens - a.completion_tokens > 2
                               for a, b in zip(run.feedback, run.feedback[1:])),
                   60.0, "a step with more than 2 tokens at K = 3")
        [result] = client.set_parameters(spec__draft_max=1)
        assert result.successful, result.reason
        switched_at = len(run.feedback)
        wait_until(lambda: sum(f.draft_max == 1 for f in run.feedback[switched_at:]) >= 20, 90.0,
                   "20 steps at K = 1")
        [result] = client.set_parameters(spec__mode="off")
        assert result.successful, result.reason
        off_at = len(run.feedback)
        final = run.wait_result()
        assert final.spec_mode == "off" and final.stats.spec_mode == "off"
        wait_until(lambda: run.streamed_text == final.text, 5.0, "all text streamed as feedback")
        after = run.feedback[switched_at:]
        k1 = [i for i, f in enumerate(after) if f.draft_max == 1][0]
        gains = [b.completion_tokens - a.completion_tokens for a, b in zip(after[k1:], after[k1 + 1:])]
        assert max(gains) <= 2, gains  # one drafted token + the bonus token, at most
        assert 2 in gains, gains  # lookup still drafted (and was accepted) at K = 1
        # Feedback of the step in flight during the switch may still say lookup; then only off.
        modes = [f.spec_mode for f in run.feedback[off_at:]]
        assert "off" in modes and set(modes[modes.index("off"):]) == {"off"}, modes

        refused = {"draft": "needs a draft model", "warp": "expected one of"}
        for mode, reason in refused.items():
            [result] = client.set_parameters(spec__mode=mode)
            assert not result.successful and reason in result.reason
        for configure_time in (dict(target__n_ctx=1024), dict(queue__result_timeout=5.0)):
            # a value read at configure only: a runtime set would silently do nothing
            [result] = client.set_parameters(**configure_time)
            assert not result.successful and "only change while unconfigured" in result.reason
    finally:
        assert all(r.successful for r in client.set_parameters(spec__mode="lookup", spec__draft_max=K))


@pytest.mark.timeout(120)
def test_feedback_rate_limit_keeps_all_text(client: GenerateClient) -> None:
    """active: with feedback.min_period long, a goal gets its first and last feedback only, and the
    text between them is carried by the last one."""
    assert client.set_parameters(feedback__min_period=60.0)[0].successful
    try:
        run = client.send(prompt=PROMPT, max_tokens=12, seed=2)
        result = run.wait_result()
    finally:
        assert client.set_parameters(feedback__min_period=0.0)[0].successful
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    assert len(run.feedback) == 2 and run.feedback[0].completion_tokens == 1
    assert run.feedback[-1].completion_tokens == 12


@pytest.mark.timeout(120)
def test_non_ascii_feedback_is_whole_characters(client: GenerateClient) -> None:
    """Gemma spells rare characters with byte tokens: every feedback message still carries whole
    UTF-8 characters, and together they are the result's text."""
    run = client.send(prompt="Accents français : é, è, à, ç, ê, ô, û. Emoji : 🤖 🚀 ✨. Encore :",
                      max_tokens=24, temperature=0.0)
    result = run.wait_result()
    wait_until(lambda: run.streamed_text == result.text, 5.0, "all text streamed as feedback")
    assert any(ord(c) > 127 for c in result.text), result.text
    assert all("\ufffd" not in f.text for f in run.feedback)


@pytest.mark.timeout(120)
def test_chat_template_and_system_prompt_through_a_goal(client: GenerateClient, embedded_model_path: Path) -> None:
    """use_chat_template: the prompt (and system prompt) wrapped in Gemma's template with its control
    tokens, as the result's prompt_tokens shows; the system prompt adds its own tokens."""
    def prompt_tokens(**fields: Any) -> int:
        run = client.send(prompt="Name one robot.", max_tokens=4, **fields)
        result = run.wait_result()
        assert run.status == GoalStatus.STATUS_SUCCEEDED, result.error
        assert result.completion_tokens == 4 or result.finish_reason == "stop"
        return result.prompt_tokens

    raw = len(tokenize(embedded_model_path, "Name one robot."))
    system = len(tokenize(embedded_model_path, "Be brief.", add_bos=False))
    templated = prompt_tokens(use_chat_template=True)
    # <start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n: control tokens + role words
    assert templated >= raw + 6
    assert prompt_tokens(use_chat_template=True, system_prompt="Be brief.") >= templated + system
    assert prompt_tokens(system_prompt="Be brief.") >= raw + system


@pytest.mark.timeout(120)
def test_diagnostics_carry_the_named_status(client: GenerateClient, node: GemmaSpecNode) -> None:
    """active, after a request of its own: the status has tau and the other keys, equal to the
    engine's lifetime stats; lookup on this code (adaptive off) has tau > 1."""
    assert client.send(prompt=PROMPT, max_tokens=48, seed=1).wait_result().finish_reason == "length"
    rolling = node._engine.rolling_stats()  # no other request runs: these are the published ones
    status = client.wait_status(SPEC_STATUS, lambda s: key_values(s)["state"] == "active" and
                                int(key_values(s)["requests ok"]) >= 1)
    values = key_values(status)
    for key in ("mode", "tau (mean acceptance length)", "acceptance rate", "K (draft_max)", "tokens/s",
                "TTFT p50 ms", "latency p50 s", "latency p95 s", "queue depth", "requests ok",
                "requests failed", "requests cancelled", "requests rejected", "last rejection",
                "RSS MiB"):
        assert key in values, key
    assert status.level in (DiagnosticStatus.OK, DiagnosticStatus.WARN)  # WARN: timing-dependent
    assert status.hardware_id and values["mode"] == "lookup" and values["K (draft_max)"] == str(K)
    assert float(values["tokens/s"]) > 0 and float(values["RSS MiB"]) > 0
    tau = float(values["tau (mean acceptance length)"])
    assert tau > 1.0 and tau == pytest.approx(rolling.mean_acceptance_length, rel=0.01)
    assert float(values["acceptance rate"]) == pytest.approx(rolling.acceptance_rate, rel=0.01, abs=1e-3)


@pytest.mark.timeout(120)
def test_engine_error_aborts_the_goal_and_the_node_keeps_serving(client: GenerateClient,
                                                                  node: GemmaSpecNode,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """active: an engine failure (injected: the real engine cannot be made to fail a rollback on
    demand) aborts that goal with the error text and turns diagnostics ERROR; the next goal works."""
    engine = node._engine

    def failing_generate(request, cancel=None, prompt=None):  # noqa: ANN001  the engine's signature
        raise KVCacheError("llama_memory_seq_rm refused to remove cells (test)")
        yield  # pragma: no cover  (a generator, like the real one)

    monkeypatch.setattr(engine, "generate", failing_generate)
    run = client.send(prompt="Hello", max_tokens=4)
    result = run.wait_result()
    assert run.status == GoalStatus.STATUS_ABORTED
    assert result.finish_reason == "error" and "refused to remove cells" in result.error
    client.wait_status(SPEC_STATUS, lambda s: s.level == DiagnosticStatus.ERROR)

    monkeypatch.undo()
    run = client.send(prompt="Hello", max_tokens=4)
    assert run.wait_result().finish_reason == "length" and run.status == GoalStatus.STATUS_SUCCEEDED
    client.wait_status(SPEC_STATUS, lambda s: s.level in (DiagnosticStatus.OK, DiagnosticStatus.WARN))


@pytest.mark.timeout(120)
def test_deactivate_cancels_the_running_goal_and_reports_inactive(client: GenerateClient) -> None:
    """active -> inactive while a goal runs: it ends cancelled (ABORTED: not its client's cancel);
    diagnostics say "inactive" at level OK (never STALE: the node is alive); goals are rejected;
    activate serves again."""
    run = client.send(**long_goal())
    run.wait_feedback(1)
    waiting = client.send(prompt="Hello", max_tokens=2)
    assert client.transition("deactivate") is True
    for goal in (run, waiting):
        result = goal.wait_result()
        assert goal.status == GoalStatus.STATUS_ABORTED
        assert result.finish_reason == "cancelled" and "deactivated" in result.error
    assert waiting.result.completion_tokens == 0
    assert client.state() == "inactive"
    client.wait_status(SPEC_STATUS, lambda s: s.level == DiagnosticStatus.OK and s.message == "inactive")
    assert not client.send(prompt="Hello", max_tokens=2).accepted
    assert client.transition("activate") is True
    assert client.send(prompt="Hello", max_tokens=2).wait_result().finish_reason == "length"


CACHE_PROMPT = "The little robot woke up in the empty warehouse and"


@pytest.mark.timeout(300)
def test_dynamic_cache_survives_a_restart_then_lifecycle_down_to_finalized(
        ros: None, f16_model_path: Path, tmp_path: Path) -> None:
    """A node of its own, on the F16 copy (batch-invariant logits, so the same greedy request gives
    the same text whatever was drafted; on Q4_K_M a draft can flip a near-tie): cleanup saves the dynamic n-gram cache with this request's n-grams; the
    next configure loads it, and the same request then drafts from it. Then active -> inactive ->
    unconfigured -> finalized through ~/change_state and ~/get_state."""
    name = "gemma_spec_finalize"
    dynamic = tmp_path / "dynamic.bin"
    with node_factory() as serve:
        own = serve(name, overrides(f16_model_path, dynamic), activate=False).client
        bring_up(own)
        goal = dict(prompt=CACHE_PROMPT, max_tokens=24, temperature=0.0, seed=1)
        first = [own.send(**goal).wait_result() for _ in range(2)]  # the dynamic cache's strict
        assert own.transition("deactivate") and own.transition("cleanup")  # thresholds want 2
        assert own.state() == "unconfigured" and dynamic.stat().st_size > 0
        _, saved = learned_cache.read(dynamic)
        prompt = tokenize(f16_model_path, CACHE_PROMPT)
        for i in range(len(prompt) - 4):
            assert saved.get(tuple(prompt[i:i + 4])).get(prompt[i + 4], 0) >= 2, i
        bring_up(own)
        again = own.send(**goal).wait_result()
        assert again.text == first[0].text == first[1].text
        assert again.stats.num_accepted_tokens >= first[0].stats.num_accepted_tokens + 8, (
            again.stats, first[0].stats)
        assert again.stats.num_steps < first[0].stats.num_steps

        assert own.transition("deactivate") is True and own.state() == "inactive"
        assert own.transition("cleanup") is True and own.state() == "unconfigured"
        assert own.transition("shutdown") is True and own.state() == "finalized"
