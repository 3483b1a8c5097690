"""Gemma 4 MTP drafting (engine/drafters/mtp.py) on tiny gemma4 + gemma4-assistant pairs written with gguf-py.

Two pairs (test/support/tiny_gemma4.py): **random** weights, whose assistant is right about as often as
chance (every round rejected: rollback and carry-over are exercised at every step), and an
**agreeing** pair whose assistant predicts the target by construction (acceptance ~1: accepted
drafts flow through verification, stats and the policy). Both are F32 with a 64-token sliding
window, so 200-token generations also run over a wrapped window cache.

Tests marked ``exact`` compare tokens with plain decoding and need llama.cpp's exact build; under
the default build they skip here and test/engine/test_exact_build.py runs them under the exact build.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.llama.gguf import architecture
from gemma_spec_ros.engine.drafters.mtp import AssistantMismatchError, TargetHiddenRows, is_assistant
from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support import linked_head
from support.engine import build_engine
from support.maths import softmax
from support.linked_head import check_k_and_mode_switched_while_generating, check_under_a_grammar
from support.tiny_gemma4 import write_gemma4_assistant, write_gemma4_pair
from support.tiny_gguf import write_tiny_gguf

N_CTX = 512
LONG = 200  # tokens of the parity runs: past the assistant's 64-token sliding window, three times
PROMPT = "the robot picks up the red cup. "
#: measured on the agreeing pair at K = 3, greedy: 1.0 (every drafted token accepted)
AGREEING_ACCEPTANCE_FLOOR = 0.9


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    return write_gemma4_pair(tmp_path_factory.mktemp("gemma4"), agreeing=False)


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    return write_gemma4_pair(tmp_path_factory.mktemp("gemma4"), agreeing=True)


def make_engine(pair: Tuple[Path, Path], n_batch: int = 512, **spec: object) -> Engine:
    """p_min 0 and a fixed K by default: the random assistant's confidence is low, and the test
    wants every step drafted."""
    target, assistant = pair
    settings = dict(mode="mtp", draft_max=3, p_min=0.0, adaptive=False)
    settings.update(spec)
    return build_engine(target, assistant, n_ctx=N_CTX, n_threads=1, n_batch=n_batch, calibrate=True,
                        spec=SpecConfig(**settings))


@pytest.fixture
def random_engine(random_pair: Tuple[Path, Path]):
    engine = make_engine(random_pair)
    yield engine
    engine.close()


@pytest.fixture
def agreeing_engine(agreeing_pair: Tuple[Path, Path]):
    engine = make_engine(agreeing_pair)
    yield engine
    engine.close()


def run(engine: Engine, mode: str, max_tokens: int = LONG, sampling: SamplingParams = SamplingParams(),
        cancel: threading.Event = None) -> Tuple[List[int], List[Step]]:
    return linked_head.run(engine, mode, PROMPT, max_tokens, sampling, cancel)


# -- the pair and the drafter's kind -----------------------------------------------------------------
def test_the_drafter_kind_comes_from_the_gguf_architecture(random_pair, random_engine) -> None:
    target, assistant = random_pair
    assert architecture(str(target)) == "gemma4" and architecture(str(assistant)) == "gemma4-assistant"
    assert is_assistant(str(assistant)) and not is_assistant(str(target))
    assert set(random_engine.drafters) == {"mtp", "lookup", "suffix"}  # no standalone draft model
    info = random_engine.model_info()["draft"]
    assert info["architecture"] == "gemma4-assistant" and info["drafter"] == "mtp"
    assert info["path"] == str(assistant) and info["n_embd_target"] == 64


def test_drafts_are_proposed_verified_and_rolled_back(random_engine) -> None:
    """Random weights: nearly every draft is rejected, so every step rolls the target back and the
    next draft starts from the carried-over hidden row; all of it is counted per drafter."""
    tokens, steps = run(random_engine, "mtp", max_tokens=60)
    stats = steps[-1].stats
    assert len(tokens) == 60 and stats.num_drafts >= 40
    assert stats.drafts_by_source == {"mtp": stats.num_drafts}
    # p_min 0: K tokens, but for the last steps (a draft never runs past max_tokens)
    assert stats.drafted_at[0] == stats.num_drafts and stats.drafted_at[2] >= stats.num_drafts - 2
    assert stats.acceptance_rate < 0.2, stats.acceptance_rate
    assert {s.spec_mode for s in steps} == {"mtp"}
    assert stats.draft_time > 0 and stats.verify_time > 0


def test_the_assistant_writes_nothing_into_the_target_cache(random_engine) -> None:
    """The assistant attends to the target's cells and adds none (llama.cpp's shared memory)."""
    import llama_cpp

    run(random_engine, "mtp", max_tokens=20)
    target = random_engine.target
    drafter = random_engine.drafters["mtp"].drafter
    memory = llama_cpp.llama_get_memory(target.handles[1])
    before = llama_cpp.llama_memory_seq_pos_max(memory, 0)
    assert before == target.n_past - 1
    drafter.propose(list(target.kv_tokens) + [5], 3, random_engine.spec)
    assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == before


@pytest.mark.parametrize("n_batch", [512, 3])
def test_the_carried_hidden_row_is_the_target_state_of_the_last_position(random_pair, n_batch) -> None:
    """After many rejected rounds, the row the next draft starts from equals a fresh target's
    hidden state at that position (one decode of the whole sequence): nothing stale carried over.
    n_batch 3 splits each 4-row verify pass in two chunks: a rejected draft's row is in the first."""
    engine = make_engine(random_pair, n_batch=n_batch)
    try:
        _, steps = run(engine, "mtp", max_tokens=80)
        stats = steps[-1].stats
        assert stats.acceptance_rate < 0.2  # mostly row 0 carried over
        assert stats.num_drafts >= stats.num_steps - 1  # each found its row (the last may not draft)
        target = engine.target
        carried = engine.drafters["mtp"].drafter.hidden.row(target.n_past - 1)
        assert carried is not None
        assert engine.drafters["mtp"].drafter.hidden.row(target.n_past) is None  # past the cache
        tokens = list(target.kv_tokens)
    finally:
        engine.close()
    fresh = LlamaModel(ModelConfig(str(random_pair[0]), n_ctx=N_CTX, n_threads=1))
    rows = TargetHiddenRows(fresh)
    try:
        rows.enable(True)
        fresh.decode(tokens, [len(tokens) - 1])
        expected = rows.row(len(tokens) - 1)
    finally:
        rows.close()
        fresh.close()
    # bit-identical under the exact build; the fast build's batched products differ by rounding
    np.testing.assert_allclose(carried, expected, rtol=0, atol=1e-4)


def test_the_agreeing_pair_accepts_nearly_every_draft(agreeing_engine) -> None:
    """τ and acceptance per position in SpecStats; the output is plain decoding's (the agreeing
    target's margins are far above any rounding, so this holds under either build)."""
    reference, _ = run(agreeing_engine, "off")
    tokens, steps = run(agreeing_engine, "mtp")
    stats = steps[-1].stats
    assert tokens == reference and len(tokens) == LONG
    assert stats.acceptance_rate > AGREEING_ACCEPTANCE_FLOOR, stats.acceptance_rate
    assert stats.mean_acceptance_length > 1 + 3 * AGREEING_ACCEPTANCE_FLOOR
    assert len(stats.acceptance_per_position) == 3
    assert min(stats.acceptance_per_position) > AGREEING_ACCEPTANCE_FLOOR, stats.acceptance_per_position
    assert stats.num_steps < LONG / 3  # ~4 tokens per target pass


def test_the_adaptive_policy_measures_the_assistant(agreeing_pair) -> None:
    """Adaptive K from measured costs: the policy sees the mtp drafter's draft cost and drafts."""
    engine = make_engine(agreeing_pair, adaptive=True, draft_max=4, p_min=0.75)
    try:
        _, steps = run(engine, "mtp")
        assert engine.costs.draft_cost("mtp", 1) > 0
        assert steps[-1].stats.num_drafts > 0
        _, auto_steps = run(engine, "auto")
        assert "mtp" in auto_steps[-1].stats.drafts_by_source  # auto's candidates include mtp
        assert "auto:mtp" in {s.spec_mode for s in auto_steps}
    finally:
        engine.close()


# -- lossless: token for token what plain decoding emits ---------------------------------------------
@pytest.mark.exact
@pytest.mark.timeout(300)
def test_greedy_mtp_equals_off_token_for_token(exact_build, random_engine) -> None:
    reference, _ = run(random_engine, "off")
    tokens, steps = run(random_engine, "mtp")
    assert len(reference) == LONG and tokens == reference
    assert steps[-1].stats.num_drafts > LONG / 2


@pytest.mark.exact
@pytest.mark.timeout(300)
def test_seeded_sampling_mtp_equals_off(exact_build, random_engine) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    reference, _ = run(random_engine, "off", sampling=sampling)
    tokens, steps = run(random_engine, "mtp", sampling=sampling)
    assert len(reference) == LONG and tokens == reference
    assert steps[-1].stats.num_drafts > LONG / 2
    other, _ = run(random_engine, "off", sampling=replace(sampling, seed=99))
    assert other != reference  # the seed matters: the equality above is not vacuous


# -- runtime control ---------------------------------------------------------------------------------
def test_cancel_while_the_assistant_drafts(agreeing_engine) -> None:
    """A cancel that arrives while the assistant is drafting ends the request at that step with
    its tokens so far (plain decoding's prefix); the engine then serves the next request."""
    reference, _ = run(agreeing_engine, "off")
    drafter = agreeing_engine.drafters["mtp"].drafter
    cancel = threading.Event()
    real_step = drafter.assistant.step
    calls = []

    def step_then_cancel(*args):  # a real assistant step, with the cancel landing during it
        calls.append(args)
        if len(calls) == 20:
            cancel.set()
        return real_step(*args)

    drafter.assistant.step = step_then_cancel
    try:
        tokens, steps = run(agreeing_engine, "mtp", cancel=cancel)
    finally:
        del drafter.assistant.step
    assert steps[-1].finish_reason == "cancelled"
    assert 0 < len(tokens) < LONG and tokens == reference[:len(tokens)]
    assert len(calls) <= 21  # the draft in progress finished; no step drafted after the cancel
    again, _ = run(agreeing_engine, "mtp")
    assert again == reference


def test_k_and_mode_switched_while_generating(agreeing_engine) -> None:
    """K 3 -> 1, then mode mtp -> off -> mtp at step boundaries (support/linked_head.py)."""
    check_k_and_mode_switched_while_generating(agreeing_engine, PROMPT, LONG, 3)


def test_a_grammar_keeps_the_output_and_decides_rows_without_logits(agreeing_engine) -> None:
    check_under_a_grammar(agreeing_engine, PROMPT, 80)


def test_hidden_rows_are_exported_only_while_mtp_may_draft(agreeing_engine, random_pair) -> None:
    """off and lookup (and every engine without an assistant) pay nothing for MTP: the target
    neither exports hidden rows nor copies them."""
    target, drafter = agreeing_engine.target, agreeing_engine.drafters["mtp"].drafter
    for mode, exported in (("off", False), ("mtp", True), ("lookup", False), ("auto", True)):
        run(agreeing_engine, mode, max_tokens=8)
        assert drafter.hidden.enabled is exported, mode
        assert (target.after_chunk is not None) is exported, mode
    plain = build_engine(random_pair[0], n_ctx=N_CTX, n_threads=1, calibrate=True, spec=SpecConfig(mode="lookup"))
    try:
        run(plain, "lookup", max_tokens=8)
        assert plain.target.after_chunk is None and "mtp" not in plain.drafters
    finally:
        plain.close()


def test_rejection_verification_uses_the_assistant_distribution(agreeing_engine) -> None:
    """Sampled requests under ``rejection``: the drafts are sampled, with their q, and verified."""
    agreeing_engine.update_spec(replace(agreeing_engine.spec, verification="rejection"))
    drafter = agreeing_engine.drafters["mtp"].drafter
    drafts = []
    real_propose = drafter.propose
    drafter.propose = lambda *args: drafts.append(real_propose(*args)) or drafts[-1]
    try:
        tokens, steps = run(agreeing_engine, "mtp", max_tokens=60,
                            sampling=SamplingParams(temperature=0.7, seed=3))
    finally:
        del drafter.propose
    stats = steps[-1].stats
    assert len(tokens) == 60 and stats.verification == "rejection"
    assert drafts and all(d.probs is not None and len(d.probs) == len(d.tokens) for d in drafts if d.tokens)
    assert all(abs(float(q.sum()) - 1.0) < 1e-6 for d in drafts for q in (d.probs or ()))
    assert stats.acceptance_rate > 0.5, stats.acceptance_rate  # q close to p: most accepted


# -- refusals at configure ---------------------------------------------------------------------------
def test_an_assistant_of_another_hidden_size_is_refused(random_pair, tmp_path: Path) -> None:
    other = write_gemma4_assistant(tmp_path / "assistant-32.gguf", hidden_size=32)
    with pytest.raises(AssistantMismatchError, match="hidden states of size 32.*has 64"):
        make_engine((random_pair[0], other))


def test_an_assistant_of_another_vocabulary_is_refused(random_pair, tmp_path: Path) -> None:
    other = write_gemma4_assistant(tmp_path / "assistant-v200.gguf", vocab_size=200)
    with pytest.raises(AssistantMismatchError, match="vocabulary of 200 tokens.*256"):
        make_engine((random_pair[0], other))


def test_a_target_that_is_not_gemma4_is_refused(random_pair, tmp_path: Path) -> None:
    gemma3 = write_tiny_gguf(tmp_path / "gemma3.gguf", vocab_size=256, n_embd=64, arch="gemma3")
    with pytest.raises(AssistantMismatchError, match="only for a Gemma 4 target.*gemma3"):
        make_engine((gemma3, random_pair[1]))


def test_an_n_ctx_unlike_the_targets_is_refused(random_pair) -> None:
    target, assistant = random_pair
    with pytest.raises(AssistantMismatchError, match=r"n_ctx \(256\) must be the target's \(512\)"):
        Engine(EngineConfig(target=ModelConfig(str(target), n_ctx=N_CTX, n_threads=1),
                            draft=ModelConfig(str(assistant), n_ctx=256, n_threads=1)))


def test_modes_that_need_another_drafter_are_refused(random_pair, random_engine) -> None:
    """mtp without an assistant (config, runtime switch, goal) and draft with one."""
    with pytest.raises(ValueError, match="needs a Gemma 4 assistant"):
        EngineConfig(target=ModelConfig(str(random_pair[0])), spec=SpecConfig(mode="mtp"))
    plain = build_engine(random_pair[0], n_ctx=N_CTX, n_threads=1, calibrate=True)
    try:
        assert "needs a Gemma 4 assistant" in plain.check_spec(SpecConfig(mode="mtp"))
        with pytest.raises(ValueError, match="needs a Gemma 4 assistant"):
            plain.update_spec(SpecConfig(mode="mtp"))
        with pytest.raises(ValueError, match="needs a Gemma 4 assistant"):
            plain.check_request(GenerationRequest(PROMPT, spec_mode="mtp"))
    finally:
        plain.close()
    for mode in ("draft", "draft+lookup"):
        assert "names a Gemma 4 assistant" in random_engine.check_spec(SpecConfig(mode=mode))
    assert random_engine.check_spec(SpecConfig(mode="auto")) == ""


def test_a_gemma4_target_is_no_assistant(random_pair) -> None:
    """A Gemma 4 model named as the draft is a standalone draft model (the target itself here)."""
    target, _ = random_pair
    engine = build_engine(target, target, n_ctx=N_CTX, n_threads=1, calibrate=True, spec=SpecConfig(mode="draft"))
    try:
        assert "draft" in engine.drafters and "mtp" not in engine.drafters
    finally:
        engine.close()


def test_the_agreeing_target_is_what_its_docstring_says(agreeing_pair) -> None:
    """The helper's claim the acceptance test rests on: next token = succ(current token)."""
    from support.tiny_gemma4 import successor_cycle
    from support.tiny_gguf import logits_of

    succ = successor_cycle()
    tokens = [1, 40, 41, 77, 200, 9]
    rows = logits_of(agreeing_pair[0], tokens)
    assert [int(r.argmax()) for r in rows[1:]] == [int(succ[t]) for t in tokens[1:]]


@pytest.mark.timeout(300)
def test_rejection_sampling_with_the_assistant_keeps_the_target_distribution(random_pair) -> None:
    """``rejection`` accepts the random assistant's sampled draft with min(1, p/q) and resamples
    the residual: the second token (the first the assistant drafts) must follow the target's own
    marginal P(t2) = sum_t1 P(t1) P(t2 | t1), exactly computed here (chi-square, fixed seeds)."""
    from support.stats import chi_square_p_value
    from support.tiny_gguf import EOS_ID

    engine = make_engine(random_pair, draft_max=2, verification="rejection")
    try:
        backend, vocab = engine.target, engine.target.n_vocab
        prompt = engine.prompt_tokens(GenerationRequest(PROMPT))

        def next_dist(tokens: List[int]) -> np.ndarray:
            backend.clear()
            return softmax(backend.decode(tokens, [len(tokens) - 1])[0])

        p1 = next_dist(prompt)
        p2 = np.zeros(vocab + 1)  # + "no second token" (EOS came first)
        p2[vocab] = p1[EOS_ID]
        for t1 in range(vocab):
            if t1 != EOS_ID:
                p2[:vocab] += p1[t1] * next_dist(prompt + [t1])
        backend.clear()
        counts = np.zeros(vocab + 1)
        drafted = accepted = 0
        for seed in range(3000):
            tokens, steps = run(engine, "mtp", max_tokens=3, sampling=SamplingParams(temperature=1.0, seed=seed))
            counts[tokens[1] if len(tokens) > 1 else vocab] += 1
            drafted += steps[-1].stats.num_draft_tokens
            accepted += steps[-1].stats.num_accepted_tokens
    finally:
        engine.close()
    assert drafted > 2000 and 0 < accepted < drafted  # acceptance and residual resampling both ran
    # categories expected below 5 times pooled into one (chi-square needs expected counts >= 5)
    small = p2 * counts.sum() < 5
    pooled_p = np.append(p2[~small], p2[small].sum())
    pooled_counts = np.append(counts[~small], counts[small].sum())
    assert chi_square_p_value(pooled_counts, pooled_p) > 1e-3
