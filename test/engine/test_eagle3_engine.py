"""EAGLE-3 drafting through the real Engine (``spec.mode: eagle3``, a member of ``auto``) on the tiny
gemma4 targets + eagle3 heads of test/support/tiny_eagle3.py.

test/engine/test_eagle3.py drives the drafter in a minimal loop; here the engine's own loop drives
it through the drafter protocol alone (``before_target_pass``, ``propose``, ...): the kind of
drafter comes from the GGUF named by ``draft.model_path``, the target exports its layer features
only for the passes of a step whose mode may draft with the head, and the policy, the stats,
cancel and runtime switches all see it as any other drafter.

Two pairs: a **random** head (nearly every draft rejected: the head's cache is rolled back at every
step) and an **agreeing** one (acceptance ~1). Tests marked ``exact`` compare tokens with ``off``
and need llama.cpp's exact build; under the default build they skip here and
test/engine/test_exact_build.py runs them under the exact build.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.drafters.eagle3 import Eagle3Drafter, HeadMismatchError
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import EngineError
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support import linked_head
from support.engine import build_engine
from support.linked_head import check_k_and_mode_switched_while_generating, check_under_a_grammar
from support.tiny_eagle3 import write_eagle3_head, write_eagle3_pair
from support.tiny_gemma4 import write_gemma4_pair
from support.tiny_gguf import write_tiny_gguf

N_CTX = 512
LONG = 200  # tokens of the parity runs: past the target's 64-token sliding window, three times
PROMPT = "the robot picks up the red cup. "
K = 3
#: measured on the agreeing pair at K = 3, greedy: 1.0 (every drafted token accepted)
AGREEING_ACCEPTANCE_FLOOR = 0.9
#: the agreeing target sampled at this temperature leaves succ(t) often enough to reject some drafts
#: (measured, seed 21: acceptance 0.70 over 200 tokens; at 2.0 already 0.04)
TEMPERATURE_MIXED = 1.0

Pair = Tuple[Path, Path]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return write_eagle3_pair(tmp_path_factory.mktemp("eagle3"), agreeing=False)


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return write_eagle3_pair(tmp_path_factory.mktemp("eagle3"), agreeing=True)


def make_engine(pair: Pair, n_batch: int = 512, **spec: object) -> Engine:
    """p_min 0 and a fixed K by default: the random head is unsure, and the test wants every step
    drafted."""
    target, head = pair
    settings = dict(mode="eagle3", draft_max=K, p_min=0.0, adaptive=False)
    settings.update(spec)
    return build_engine(target, head, n_ctx=N_CTX, n_threads=1, n_batch=n_batch, calibrate=True,
                        spec=SpecConfig(**settings))


@pytest.fixture
def random_engine(random_pair: Pair):
    engine = make_engine(random_pair)
    yield engine
    engine.close()


@pytest.fixture
def agreeing_engine(agreeing_pair: Pair):
    engine = make_engine(agreeing_pair)
    yield engine
    engine.close()


def run(engine: Engine, mode: str, max_tokens: int = LONG, sampling: SamplingParams = SamplingParams(),
        cancel: threading.Event = None, prompt: str = PROMPT) -> Tuple[List[int], List[Step]]:
    return linked_head.run(engine, mode, prompt, max_tokens, sampling, cancel)


def eagle3_of(engine: Engine) -> Eagle3Drafter:
    return engine.drafters["eagle3"].drafter


def draft_distributions(drafter: Eagle3Drafter, context: Sequence[int]) -> List[np.ndarray]:
    """The head's q at each of K sampled draft positions after ``context`` (fixed seeds)."""
    drafter.begin(list(context), SamplingParams(temperature=1.0, seed=5), np.random.default_rng(11))
    draft = drafter.propose(list(context), K, SpecConfig(p_min=0.0, adaptive=False))
    drafter.begin(list(context))
    assert draft.probs is not None and len(draft.probs) == K
    return list(draft.probs)


# -- the drafter's kind comes from the GGUF ----------------------------------------------------------
def test_draft_model_path_naming_a_head_loads_the_eagle3_drafter(random_pair: Pair, random_engine: Engine) -> None:
    assert set(random_engine.drafters) == {"eagle3", "lookup", "suffix"}  # no standalone draft model, no MTP
    assert random_engine.draft is eagle3_of(random_engine)
    info = random_engine.model_info()["draft"]
    assert info["drafter"] == "eagle3" and info["architecture"] == "eagle3"
    assert info["path"] == str(random_pair[1]) and info["target_layers"] == [0, 1, 2]


def test_drafts_are_proposed_verified_and_rolled_back(random_engine: Engine) -> None:
    """Random weights: nearly every draft is rejected; each one is counted for the eagle3 drafter."""
    tokens, steps = run(random_engine, "eagle3", max_tokens=60)
    stats = steps[-1].stats
    assert len(tokens) == 60 and stats.num_drafts >= 40
    assert stats.drafts_by_source == {"eagle3": stats.num_drafts}
    assert stats.drafted_at[0] == stats.num_drafts and stats.drafted_at[2] >= stats.num_drafts - 2
    assert stats.acceptance_rate < 0.2, stats.acceptance_rate
    assert {s.spec_mode for s in steps} == {"eagle3"}
    assert stats.draft_time > 0 and stats.verify_time > 0


@pytest.mark.parametrize("n_batch", [512, 3])
def test_the_head_cache_follows_every_rollback_of_the_engine(random_pair: Pair, n_batch: int) -> None:
    """After 80 tokens of rejected rounds in the engine's loop (and a second request that shares the
    first's prefix), the head drafts what a head that never drafted before drafts from the same
    context: nothing stale in its KV cache or its g rows. n_batch 3 splits each verify pass."""
    engine = make_engine(random_pair, n_batch=n_batch)
    try:
        run(engine, "eagle3", max_tokens=40)
        tokens, steps = run(engine, "eagle3", max_tokens=80, prompt=PROMPT + "then it puts the cup down.")
        assert steps[-1].stats.acceptance_rate < 0.2 and steps[-1].stats.num_drafts >= 70
        assert steps[-1].stats.num_prompt_tokens_reused > 0
        context = list(engine.target.kv_tokens) + [tokens[-1]]
        long_run = draft_distributions(eagle3_of(engine), context)
    finally:
        engine.close()
    target = LlamaModel(ModelConfig(str(random_pair[0]), n_ctx=N_CTX, n_threads=1))
    try:
        fresh = Eagle3Drafter(ModelConfig(str(random_pair[1]), n_ctx=N_CTX, n_threads=1), target)
        try:
            fresh.before_target_pass(True)
            target.decode(context[:-1], [len(context) - 2])
            expected = draft_distributions(fresh, context)
        finally:
            fresh.close()
    finally:
        target.close()
    for q_long, q_fresh in zip(long_run, expected):  # bit-identical under the exact build
        np.testing.assert_allclose(q_long, q_fresh, rtol=0, atol=1e-5)


def test_the_agreeing_head_accepts_nearly_every_draft(agreeing_engine: Engine) -> None:
    """Accepted drafts flow through the engine's whole path (verification, stats, the head's
    catch-up); tau and acceptance per position in SpecStats; the output is ``off``'s."""
    reference, _ = run(agreeing_engine, "off")
    tokens, steps = run(agreeing_engine, "eagle3")
    stats = steps[-1].stats
    assert tokens == reference and len(tokens) == LONG
    assert stats.acceptance_rate > AGREEING_ACCEPTANCE_FLOOR, stats.acceptance_rate
    assert stats.mean_acceptance_length > 1 + K * AGREEING_ACCEPTANCE_FLOOR
    assert len(stats.acceptance_per_position) == K
    assert min(stats.acceptance_per_position) > AGREEING_ACCEPTANCE_FLOOR, stats.acceptance_per_position
    assert stats.num_steps < LONG / K  # ~4 tokens per target pass
    assert stats.drafts_by_source == {"eagle3": stats.num_drafts}


def test_sampled_requests_mix_accepted_and_rejected_drafts(agreeing_engine: Engine) -> None:
    """A hot sampled request on the agreeing pair: the greedy drafts are mostly accepted, and the
    target's samples reject some, so accepted prefixes and rollbacks of the head's cache alternate;
    the text is ``off``'s for the same seed (exact verification; the agreeing margins are far
    above any rounding)."""
    sampling = SamplingParams(temperature=TEMPERATURE_MIXED, seed=21)
    reference, _ = run(agreeing_engine, "off", sampling=sampling)
    tokens, steps = run(agreeing_engine, "eagle3", sampling=sampling)
    stats = steps[-1].stats
    assert tokens == reference and len(tokens) == LONG
    assert 0.3 < stats.acceptance_rate < 0.99, stats.acceptance_rate
    assert stats.num_accepted_tokens > LONG / 4


def test_rejection_verification_uses_the_head_distribution(agreeing_engine: Engine) -> None:
    """Sampled requests under ``rejection``: the drafts are sampled with their q (0 outside the
    head's draft vocabulary) and verified by the engine."""
    agreeing_engine.update_spec(replace(agreeing_engine.spec, verification="rejection"))
    drafter = eagle3_of(agreeing_engine)
    drafts = []
    real_propose = drafter.propose
    drafter.propose = lambda *args: drafts.append(real_propose(*args)) or drafts[-1]
    try:
        tokens, steps = run(agreeing_engine, "eagle3", max_tokens=60,
                            sampling=SamplingParams(temperature=0.7, seed=3))
    finally:
        del drafter.propose
    stats = steps[-1].stats
    assert len(tokens) == 60 and stats.verification == "rejection"
    drafted = [d for d in drafts if d.tokens]
    assert drafted and all(d.probs is not None and len(d.probs) == len(d.tokens) for d in drafted)
    assert all(abs(float(q.sum()) - 1.0) < 1e-6 and q[:3].sum() == 0 for d in drafted for q in d.probs)
    assert stats.acceptance_rate > 0.5, stats.acceptance_rate


def test_the_adaptive_policy_measures_the_head_and_auto_picks_it(agreeing_pair: Pair) -> None:
    """Adaptive K from measured costs, as for the other drafters; ``auto``'s candidates include the
    head."""
    engine = make_engine(agreeing_pair, adaptive=True, draft_max=4, p_min=0.75)
    try:
        _, steps = run(engine, "eagle3")
        assert engine.costs.draft_cost("eagle3", 1) > 0
        assert steps[-1].stats.num_drafts > 0
        _, auto_steps = run(engine, "auto")
        assert "eagle3" in auto_steps[-1].stats.drafts_by_source
        assert "auto:eagle3" in {s.spec_mode for s in auto_steps}
    finally:
        engine.close()


# -- lossless: token for token what ``off`` emits ----------------------------------------------------
@pytest.mark.exact
@pytest.mark.timeout(300)
def test_greedy_eagle3_equals_off_token_for_token(exact_build, random_engine: Engine) -> None:
    reference, _ = run(random_engine, "off")
    tokens, steps = run(random_engine, "eagle3")
    assert len(reference) == LONG and tokens == reference
    assert steps[-1].stats.num_drafts > LONG / 2


@pytest.mark.exact
@pytest.mark.timeout(300)
def test_seeded_sampling_eagle3_equals_off(exact_build, random_engine: Engine) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    reference, _ = run(random_engine, "off", sampling=sampling)
    tokens, steps = run(random_engine, "eagle3", sampling=sampling)
    assert len(reference) == LONG and tokens == reference
    assert steps[-1].stats.num_drafts > LONG / 2
    other, _ = run(random_engine, "off", sampling=replace(sampling, seed=99))
    assert other != reference  # the seed matters: the equality above is not vacuous


# -- runtime control ---------------------------------------------------------------------------------
def test_cancel_while_the_head_drafts(agreeing_engine: Engine) -> None:
    """A cancel that lands during a head step ends the request at that step with ``off``'s prefix;
    the engine then serves the next request with the head as before."""
    reference, _ = run(agreeing_engine, "off")
    head = eagle3_of(agreeing_engine).head
    cancel = threading.Event()
    real_step = head.step
    calls = []

    def step_then_cancel(*args):  # a real head step, with the cancel landing during it
        calls.append(args)
        if len(calls) == 20:
            cancel.set()
        return real_step(*args)

    head.step = step_then_cancel
    try:
        tokens, steps = run(agreeing_engine, "eagle3", cancel=cancel)
    finally:
        del head.step
    assert steps[-1].finish_reason == "cancelled"
    assert 0 < len(tokens) < LONG and tokens == reference[:len(tokens)]
    assert len(calls) <= 20 + K - 1  # the draft in progress finished; no draft after the cancel
    again, steps = run(agreeing_engine, "eagle3")
    assert again == reference and steps[-1].stats.acceptance_rate > AGREEING_ACCEPTANCE_FLOOR


def test_k_and_mode_switched_while_generating(agreeing_engine: Engine) -> None:
    """K 3 -> 1, then mode eagle3 -> off -> eagle3 at step boundaries (support/linked_head.py)."""
    check_k_and_mode_switched_while_generating(agreeing_engine, PROMPT, LONG, K)


def test_a_grammar_keeps_the_output_and_decides_rows_without_logits(agreeing_engine) -> None:
    check_under_a_grammar(agreeing_engine, PROMPT, 80)


def test_k_and_mode_switched_between_requests(agreeing_engine: Engine) -> None:
    """Each request's mode and K: the target exports the head's features only for requests whose
    mode may draft with it (off and lookup pay nothing), and every request's text is ``off``'s."""
    reference, _ = run(agreeing_engine, "off")
    target, drafter = agreeing_engine.target, eagle3_of(agreeing_engine)
    spec = agreeing_engine.spec
    for mode, k, exported in (("off", 3, False), ("eagle3", 3, True), ("lookup", 3, False),
                              ("eagle3", 1, True), ("auto", 2, True), ("off", 2, False), ("eagle3", 4, True)):
        agreeing_engine.update_spec(replace(spec, draft_max=k))
        tokens, steps = run(agreeing_engine, mode, max_tokens=60)
        assert tokens == reference[:60], (mode, k)
        assert drafter.features.enabled is exported, mode
        assert (target.after_chunk is not None) is exported, mode
        if mode == "eagle3":
            assert max(len(s.tokens) for s in steps) == k + 1, (mode, k)
            assert steps[-1].stats.drafts_by_source == {"eagle3": steps[-1].stats.num_drafts}


def test_engines_without_a_head_run_no_hook(random_pair: Pair) -> None:
    """An engine without a head (lookup, or an MTP assistant) has no eagle3 drafter and its target
    runs no per-chunk hook outside MTP's own."""
    plain = build_engine(random_pair[0], n_ctx=N_CTX, n_threads=1, calibrate=True, spec=SpecConfig(mode="auto"))
    try:
        run(plain, "auto", max_tokens=8)
        assert plain.target.after_chunk is None and "eagle3" not in plain.drafters
    finally:
        plain.close()


# -- refusals at configure ---------------------------------------------------------------------------
@pytest.mark.parametrize("head_options, message", [
    (dict(hidden_size=32), "reads target features of size 32, and the target .* has 64"),
    (dict(n_embd=32), "has a hidden size of 32, and the target .* has 64"),
    (dict(layers=(0, 1, 5)), r"reads target layers \[0, 1, 5\], and the target .* has 2 layers"),
])
def test_a_head_of_another_target_is_refused_at_configure(random_pair: Pair, tmp_path: Path,
                                                          head_options: dict, message: str) -> None:
    head = write_eagle3_head(tmp_path / "other-head.gguf", **head_options)
    with pytest.raises(HeadMismatchError, match=message):
        make_engine((random_pair[0], head))


def test_a_gemma3_target_with_a_head_of_its_final_state_is_refused_never_an_abort(
        random_pair: Pair, tmp_path: Path) -> None:
    """A gemma3 target's features are copied by an eval callback (engine/llama/features.py), which
    sees the final post-norm state only for rows asked for logits: the tiny head reads it (feature
    id 2 of a 2-layer target), so the engine refuses the pair with an EngineError that says why.
    Heads that read layer inputs draft for gemma3 (test/engine/test_eagle3_gemma3.py)."""
    gemma3 = write_tiny_gguf(tmp_path / "gemma3.gguf", vocab_size=256, n_embd=64, n_layer=2, arch="gemma3")
    with pytest.raises(EngineError, match=r"is gemma3, .*final post-norm state \(feature id 2\)"):
        make_engine((gemma3, random_pair[1]))
    with pytest.raises(HeadMismatchError):
        make_engine((gemma3, random_pair[1]), mode="auto")


def test_an_n_ctx_unlike_the_targets_is_refused(random_pair: Pair) -> None:
    target, head = random_pair
    with pytest.raises(HeadMismatchError, match=r"n_ctx \(256\) must be the target's \(512\)"):
        Engine(EngineConfig(target=ModelConfig(str(target), n_ctx=N_CTX, n_threads=1),
                            draft=ModelConfig(str(head), n_ctx=256, n_threads=1),
                            spec=SpecConfig(mode="eagle3")))


def test_modes_that_need_another_drafter_are_refused(random_pair: Pair, random_engine: Engine,
                                                     tmp_path: Path) -> None:
    """eagle3 without a head (config, runtime switch, request), the other drafters' modes with one,
    and eagle3 with an MTP assistant."""
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
        EngineConfig(target=ModelConfig(str(random_pair[0])), spec=SpecConfig(mode="eagle3"))
    plain = build_engine(random_pair[0], n_ctx=N_CTX, n_threads=1)
    try:
        reason = plain.check_spec(SpecConfig(mode="eagle3"))
        assert "needs an EAGLE-3 head (an eagle3 GGUF), and none is loaded" in reason, reason
        with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
            plain.update_spec(SpecConfig(mode="eagle3"))
        with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
            plain.check_request(GenerationRequest(PROMPT, spec_mode="eagle3"))
    finally:
        plain.close()
    for mode in ("draft", "draft+lookup", "mtp"):
        reason = random_engine.check_spec(SpecConfig(mode=mode))
        assert "names an EAGLE-3 head (an eagle3 GGUF), which drafts in spec mode 'eagle3'" in reason, reason
    assert random_engine.check_spec(SpecConfig(mode="auto")) == ""
    target, assistant = write_gemma4_pair(tmp_path)
    mtp = build_engine(target, assistant, n_ctx=N_CTX, n_threads=1, spec=SpecConfig(mode="mtp"))
    try:
        assert "eagle3" not in mtp.drafters
        assert "names a Gemma 4 assistant" in mtp.check_spec(SpecConfig(mode="eagle3"))
    finally:
        mtp.close()
