"""The two drafters that read the target's own rows, through the real Engine: Gemma 4 MTP
(``spec.mode: mtp``, a gemma4-assistant, engine/drafters/mtp.py) and EAGLE-3 (``spec.mode: eagle3``,
an eagle3 head, engine/drafters/eagle3.py). Every test here runs once per kind (``[mtp]``,
``[eagle3]``) on that kind's tiny pairs (test/support/tiny_gemma4.py, test/support/tiny_eagle3.py);
what differs between the kinds is the small data of :class:`LinkedKind`.

Covered for both: drafts proposed, verified and rolled back; an agreeing pair accepting nearly every
draft; sampled requests mixing accepted and rejected drafts; the adaptive policy measuring the
drafter and ``auto`` picking it; greedy and seeded output equal to ``off``'s; cancel while the
drafter drafts; K and mode switched while generating and between requests (the target exports
the rows the drafter reads only while a request's mode may draft with it, and an engine without
the drafter registers no chunk listener); a grammar; rejection verification with the drafter's q;
an n_ctx unlike the target's and the modes of another drafter refused. What only one kind has
(MTP's carried hidden row, the assistant writing nothing into the target cache, EAGLE-3's head
cache following rollbacks, the refusals of files made for another target or a gemma3 target) is
in test/engine/test_mtp.py and test/engine/test_eagle3_engine.py.

Two pairs per kind: **random** weights (nearly every draft rejected: the target, and the drafter's
own state, are rolled back at every step) and an **agreeing** pair (acceptance ~1). The targets
have a 64-token sliding window, so 200-token generations also run over a wrapped window cache.
Tests marked ``exact`` compare tokens with ``off`` and need llama.cpp's exact build; under the
default build they skip here and test/engine/test_exact_build.py runs them under the exact build.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest

from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.drafters.eagle3 import HeadMismatchError
from gemma_spec_ros.engine.drafters.mtp import AssistantMismatchError
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support import linked_head
from support.engine import build_engine
from support.linked_head import check_k_and_mode_switched_while_generating, check_under_a_grammar
from support.tiny_eagle3 import write_eagle3_pair
from support.tiny_gemma4 import FIRST_ORDINARY, write_gemma4_pair

N_CTX = 512
LONG = 200  # tokens of the parity runs: past the targets' 64-token sliding window, three times
PROMPT = "the robot picks up the red cup. "
K = 3
#: measured on both agreeing pairs at K = 3, greedy: 1.0 (every drafted token accepted)
AGREEING_ACCEPTANCE_FLOOR = 0.9
#: the agreeing target sampled at this temperature leaves succ(t) often enough to reject some drafts
#: (measured, seed 21: acceptance 0.70 over 200 tokens for either kind; at 2.0 already 0.04)
TEMPERATURE_MIXED = 1.0

Pair = Tuple[Path, Path]


@dataclass(frozen=True)
class LinkedKind:
    """What differs between the two linked-head drafters in these tests."""

    #: the spec mode that drafts with it, and its name in ``engine.drafters`` and the stats
    mode: str
    #: ``write_pair(directory, agreeing=...) -> (target, drafter file)``
    write_pair: Callable[..., Pair]
    #: raised at configure for a drafter file that cannot draft for the target
    mismatch_error: type
    #: the drafter's attribute for the target rows it reads (``.enabled`` while they are exported)
    rows: str
    #: the drafter's attribute whose ``step`` runs one draft step
    stepper: str
    #: draft steps that may still run after a cancel lands in one (the draft in progress finishes)
    steps_after_cancel: int
    #: ValueError's message for the mode without such a drafter (config, runtime switch, request)
    needs: str
    #: check_spec's reason for the mode without such a drafter
    needs_reason: str
    #: check_spec's reason for the other drafters' modes while this drafter is loaded
    names_reason: str
    #: the other linked kind's mode (refused with this drafter loaded)
    other_mode: str
    #: token ids below this one are outside the drafter's draft vocabulary: their q is 0
    q_zero_below: int


MTP = LinkedKind(
    mode="mtp", write_pair=write_gemma4_pair, mismatch_error=AssistantMismatchError, rows="hidden",
    stepper="assistant", steps_after_cancel=1, needs="needs a Gemma 4 assistant",
    needs_reason="needs a Gemma 4 assistant", names_reason="names a Gemma 4 assistant", other_mode="eagle3",
    q_zero_below=0)  # the assistant drafts over the whole vocabulary
EAGLE3 = LinkedKind(
    mode="eagle3", write_pair=write_eagle3_pair, mismatch_error=HeadMismatchError, rows="features",
    stepper="head", steps_after_cancel=K - 1, needs="needs an EAGLE-3 head",
    needs_reason="needs an EAGLE-3 head (an eagle3 GGUF), and none is loaded",
    names_reason="names an EAGLE-3 head (an eagle3 GGUF), which drafts in spec mode 'eagle3'", other_mode="mtp",
    q_zero_below=FIRST_ORDINARY)  # the head's draft vocabulary (d2t) holds ordinary tokens only


@pytest.fixture(scope="module", params=[MTP, EAGLE3], ids=lambda kind: kind.mode)
def kind(request: pytest.FixtureRequest) -> LinkedKind:
    return request.param


@pytest.fixture(scope="module")
def random_pair(kind: LinkedKind, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return kind.write_pair(tmp_path_factory.mktemp(kind.mode), agreeing=False)


@pytest.fixture(scope="module")
def agreeing_pair(kind: LinkedKind, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return kind.write_pair(tmp_path_factory.mktemp(kind.mode), agreeing=True)


def make_engine(kind: LinkedKind, pair: Pair, n_batch: int = 512, **spec: object) -> Engine:
    """p_min 0 and a fixed K by default: the random drafters are unsure, and the tests want every
    step drafted."""
    target, drafter = pair
    settings = dict(mode=kind.mode, draft_max=K, p_min=0.0, adaptive=False)
    settings.update(spec)
    return build_engine(target, drafter, n_ctx=N_CTX, n_threads=1, n_batch=n_batch, calibrate=True,
                        spec=SpecConfig(**settings))


@pytest.fixture
def random_engine(kind: LinkedKind, random_pair: Pair):
    engine = make_engine(kind, random_pair)
    yield engine
    engine.close()


@pytest.fixture
def agreeing_engine(kind: LinkedKind, agreeing_pair: Pair):
    engine = make_engine(kind, agreeing_pair)
    yield engine
    engine.close()


def run(engine: Engine, mode: str, max_tokens: int = LONG, sampling: SamplingParams = SamplingParams(),
        cancel: Optional[threading.Event] = None) -> Tuple[List[int], List[Step]]:
    return linked_head.run(engine, mode, PROMPT, max_tokens, sampling, cancel)


def drafter_of(engine: Engine, kind: LinkedKind):
    return engine.drafters[kind.mode].drafter


# -- drafting through the engine's loop --------------------------------------------------------------
def test_drafts_are_proposed_verified_and_rolled_back(kind: LinkedKind, random_engine: Engine) -> None:
    """Random weights: nearly every draft is rejected, so every step rolls the target (and the
    drafter's own state) back; each draft is counted for the drafter."""
    tokens, steps = run(random_engine, kind.mode, max_tokens=60)
    stats = steps[-1].stats
    assert len(tokens) == 60 and stats.num_drafts >= 40
    assert stats.drafts_by_source == {kind.mode: stats.num_drafts}
    # p_min 0: K tokens, but for the last steps (a draft never runs past max_tokens)
    assert stats.drafted_at[0] == stats.num_drafts and stats.drafted_at[K - 1] >= stats.num_drafts - 2
    assert stats.acceptance_rate < 0.2, stats.acceptance_rate
    assert {s.spec_mode for s in steps} == {kind.mode}
    assert stats.draft_time > 0 and stats.verify_time > 0


def test_the_agreeing_pair_accepts_nearly_every_draft(kind: LinkedKind, agreeing_engine: Engine) -> None:
    """Accepted drafts flow through the engine's whole path (verification, stats, the drafter's
    catch-up); tau and acceptance per position in SpecStats; the output is ``off``'s (the agreeing
    target's margins are far above any rounding, so this holds under either build)."""
    reference, _ = run(agreeing_engine, "off")
    tokens, steps = run(agreeing_engine, kind.mode)
    stats = steps[-1].stats
    assert tokens == reference and len(tokens) == LONG
    assert stats.acceptance_rate > AGREEING_ACCEPTANCE_FLOOR, stats.acceptance_rate
    assert stats.mean_acceptance_length > 1 + K * AGREEING_ACCEPTANCE_FLOOR
    assert len(stats.acceptance_per_position) == K
    assert min(stats.acceptance_per_position) > AGREEING_ACCEPTANCE_FLOOR, stats.acceptance_per_position
    assert stats.num_steps < LONG / K  # ~4 tokens per target pass
    assert stats.drafts_by_source == {kind.mode: stats.num_drafts}


def test_sampled_requests_mix_accepted_and_rejected_drafts(kind: LinkedKind, agreeing_engine: Engine) -> None:
    """A hot sampled request on the agreeing pair: the greedy drafts are mostly accepted, and the
    target's samples reject some, so accepted prefixes and rollbacks (of the head's cache; of the
    row MTP carries over, now one inside the verified rows) alternate; the text is ``off``'s for the
    same seed (exact verification; the agreeing margins are far above any rounding)."""
    sampling = SamplingParams(temperature=TEMPERATURE_MIXED, seed=21)
    reference, _ = run(agreeing_engine, "off", sampling=sampling)
    tokens, steps = run(agreeing_engine, kind.mode, sampling=sampling)
    stats = steps[-1].stats
    assert tokens == reference and len(tokens) == LONG
    assert 0.3 < stats.acceptance_rate < 0.99, stats.acceptance_rate
    assert stats.num_accepted_tokens > LONG / 4


def test_the_adaptive_policy_measures_the_drafter_and_auto_picks_it(kind: LinkedKind, agreeing_pair: Pair) -> None:
    """Adaptive K from measured costs, as for the other drafters: the policy sees the drafter's
    draft cost and drafts; ``auto``'s candidates include it."""
    engine = make_engine(kind, agreeing_pair, adaptive=True, draft_max=4, p_min=0.75)
    try:
        _, steps = run(engine, kind.mode)
        assert engine.costs.draft_cost(kind.mode, 1) > 0
        assert steps[-1].stats.num_drafts > 0
        _, auto_steps = run(engine, "auto")
        assert kind.mode in auto_steps[-1].stats.drafts_by_source
        assert f"auto:{kind.mode}" in {s.spec_mode for s in auto_steps}
    finally:
        engine.close()


# -- lossless: token for token what ``off`` emits ----------------------------------------------------
@pytest.mark.exact
@pytest.mark.timeout(300)
def test_greedy_drafting_equals_off_token_for_token(exact_build, kind: LinkedKind, random_engine: Engine) -> None:
    reference, _ = run(random_engine, "off")
    tokens, steps = run(random_engine, kind.mode)
    assert len(reference) == LONG and tokens == reference
    assert steps[-1].stats.num_drafts > LONG / 2


@pytest.mark.exact
@pytest.mark.timeout(300)
def test_seeded_sampling_with_drafts_equals_off(exact_build, kind: LinkedKind, random_engine: Engine) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    reference, _ = run(random_engine, "off", sampling=sampling)
    tokens, steps = run(random_engine, kind.mode, sampling=sampling)
    assert len(reference) == LONG and tokens == reference
    assert steps[-1].stats.num_drafts > LONG / 2
    other, _ = run(random_engine, "off", sampling=replace(sampling, seed=99))
    assert other != reference  # the seed matters: the equality above is not vacuous


# -- runtime control ---------------------------------------------------------------------------------
def test_cancel_while_the_drafter_drafts(kind: LinkedKind, agreeing_engine: Engine) -> None:
    """A cancel that lands during a draft step ends the request at that step with its tokens so far
    (``off``'s prefix); the engine then serves the next request with the drafter as before."""
    reference, _ = run(agreeing_engine, "off")
    stepper = getattr(drafter_of(agreeing_engine, kind), kind.stepper)
    cancel = threading.Event()
    real_step = stepper.step
    calls = []

    def step_then_cancel(*args):  # a real draft step, with the cancel landing during it
        calls.append(args)
        if len(calls) == 20:
            cancel.set()
        return real_step(*args)

    stepper.step = step_then_cancel
    try:
        tokens, steps = run(agreeing_engine, kind.mode, cancel=cancel)
    finally:
        del stepper.step
    assert steps[-1].finish_reason == "cancelled"
    assert 0 < len(tokens) < LONG and tokens == reference[:len(tokens)]
    assert len(calls) <= 20 + kind.steps_after_cancel  # the draft in progress finished; none after the cancel
    again, steps = run(agreeing_engine, kind.mode)
    assert again == reference and steps[-1].stats.acceptance_rate > AGREEING_ACCEPTANCE_FLOOR


def test_k_and_mode_switched_while_generating(kind: LinkedKind, agreeing_engine: Engine) -> None:
    """K 3 -> 1, then the drafter's mode -> off -> back at step boundaries (support/linked_head.py)."""
    check_k_and_mode_switched_while_generating(agreeing_engine, PROMPT, LONG, K)


def test_a_grammar_keeps_the_output_and_decides_rows_without_logits(kind: LinkedKind,
                                                                    agreeing_engine: Engine) -> None:
    check_under_a_grammar(agreeing_engine, PROMPT, 80)


def test_rows_are_exported_only_for_requests_whose_mode_may_draft_with_the_drafter(
        kind: LinkedKind, agreeing_engine: Engine) -> None:
    """K and mode switched between requests: the target exports the rows the drafter reads (MTP's
    hidden rows, the head's features) and runs a chunk listener only for requests whose mode may
    draft with it (off and lookup pay nothing), and every request's text is ``off``'s."""
    reference, _ = run(agreeing_engine, "off")
    target, drafter = agreeing_engine.target, drafter_of(agreeing_engine, kind)
    spec = agreeing_engine.spec
    for mode, k, exported in (("off", 3, False), (kind.mode, 3, True), ("lookup", 3, False),
                              (kind.mode, 1, True), ("auto", 2, True), ("off", 2, False), (kind.mode, 4, True)):
        agreeing_engine.update_spec(replace(spec, draft_max=k))
        tokens, steps = run(agreeing_engine, mode, max_tokens=60)
        assert tokens == reference[:60], (mode, k)
        assert getattr(drafter, kind.rows).enabled is exported, mode
        assert bool(target.chunk_listeners) is exported, mode
        if mode == kind.mode:
            assert max(len(s.tokens) for s in steps) == k + 1, (mode, k)
            assert steps[-1].stats.drafts_by_source == {kind.mode: steps[-1].stats.num_drafts}


@pytest.mark.parametrize("mode", ["lookup", "auto"])
def test_engines_without_the_drafter_register_no_chunk_listener(kind: LinkedKind, random_pair: Pair,
                                                                mode: str) -> None:
    """An engine on the same target without the drafter file has no such drafter, and its target
    runs no per-chunk hook: no mode pays for rows nobody reads."""
    plain = build_engine(random_pair[0], n_ctx=N_CTX, n_threads=1, calibrate=True, spec=SpecConfig(mode=mode))
    try:
        run(plain, mode, max_tokens=8)
        assert not plain.target.chunk_listeners and kind.mode not in plain.drafters
    finally:
        plain.close()


def test_rejection_verification_uses_the_drafter_distribution(kind: LinkedKind, agreeing_engine: Engine) -> None:
    """Sampled requests under ``rejection``: the drafts are sampled with their q (0 outside the
    drafter's draft vocabulary) and verified by the engine."""
    agreeing_engine.update_spec(replace(agreeing_engine.spec, verification="rejection"))
    drafter = drafter_of(agreeing_engine, kind)
    drafts = []
    real_propose = drafter.propose
    drafter.propose = lambda *args: drafts.append(real_propose(*args)) or drafts[-1]
    try:
        tokens, steps = run(agreeing_engine, kind.mode, max_tokens=60,
                            sampling=SamplingParams(temperature=0.7, seed=3))
    finally:
        del drafter.propose
    stats = steps[-1].stats
    assert len(tokens) == 60 and stats.verification == "rejection"
    drafted = [d for d in drafts if d.tokens]
    assert drafted and all(d.probs is not None and len(d.probs) == len(d.tokens) for d in drafted)
    assert all(abs(float(q.sum()) - 1.0) < 1e-6 and q[:kind.q_zero_below].sum() == 0
               for d in drafted for q in d.probs)
    assert stats.acceptance_rate > 0.5, stats.acceptance_rate  # q close to p: most accepted


# -- refusals at configure ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, "own mode"], ids=["default-spec", "own-mode"])
def test_an_n_ctx_unlike_the_targets_is_refused(kind: LinkedKind, random_pair: Pair, spec: Optional[str]) -> None:
    """Whatever the configured mode (the default, lookup, loads the drafter file too)."""
    target, drafter = random_pair
    with pytest.raises(kind.mismatch_error, match=r"n_ctx \(256\) must be the target's \(512\)"):
        Engine(EngineConfig(target=ModelConfig(str(target), n_ctx=N_CTX, n_threads=1),
                            draft=ModelConfig(str(drafter), n_ctx=256, n_threads=1),
                            spec=SpecConfig() if spec is None else SpecConfig(mode=kind.mode)))


def test_modes_that_need_another_drafter_are_refused(kind: LinkedKind, random_pair: Pair,
                                                     random_engine: Engine) -> None:
    """The drafter's mode without its file (config, runtime switch, request); the other drafters'
    modes (a draft model's, the other linked kind's) with it loaded."""
    with pytest.raises(ValueError, match=kind.needs):
        EngineConfig(target=ModelConfig(str(random_pair[0])), spec=SpecConfig(mode=kind.mode))
    plain = build_engine(random_pair[0], n_ctx=N_CTX, n_threads=1)
    try:
        reason = plain.check_spec(SpecConfig(mode=kind.mode))
        assert kind.needs_reason in reason, reason
        with pytest.raises(ValueError, match=kind.needs):
            plain.update_spec(SpecConfig(mode=kind.mode))
        with pytest.raises(ValueError, match=kind.needs):
            plain.check_request(GenerationRequest(PROMPT, spec_mode=kind.mode))
    finally:
        plain.close()
    assert kind.other_mode not in random_engine.drafters
    for mode in ("draft", "draft+lookup", kind.other_mode):
        reason = random_engine.check_spec(SpecConfig(mode=mode))
        assert kind.names_reason in reason, (mode, reason)
    assert random_engine.check_spec(SpecConfig(mode="auto")) == ""
