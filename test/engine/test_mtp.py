"""Gemma 4 MTP drafting (engine/drafters/mtp.py) on tiny gemma4 + gemma4-assistant pairs written with
gguf-py: what only the MTP assistant has.

The drafter's kind from the GGUF architecture (and a Gemma 4 target named as the draft being a
standalone draft model), the assistant writing nothing into the target's cache, the carried-over
hidden row being the target's state of the last position, the refusal of an assistant of another
hidden size or vocabulary and of a target that is not Gemma 4, and rejection sampling keeping the
target's distribution. What MTP shares with EAGLE-3 (drafts verified and rolled back, acceptance on
the agreeing pair, the policy, output equal to ``off``'s, cancel, runtime switches, grammars, row
export, the common refusals) runs for both kinds in test/engine/test_linked_heads.py.

Two pairs (test/support/tiny_gemma4.py): **random** weights, whose assistant is right about as often as
chance (every round rejected: rollback and carry-over are exercised at every step), and an
**agreeing** pair whose assistant predicts the target by construction (here only its target's
claim is checked). Both are F32 with a 64-token sliding window.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.llama.gguf import architecture
from gemma_spec_ros.engine.drafters.mtp import AssistantMismatchError, TargetHiddenRows, is_assistant
from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support import linked_head
from support.engine import build_engine
from support.maths import softmax
from support.tiny_gemma4 import write_gemma4_assistant, write_gemma4_pair
from support.tiny_gguf import write_tiny_gguf

N_CTX = 512
PROMPT = "the robot picks up the red cup. "


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


def run(engine: Engine, mode: str, max_tokens: int,
        sampling: SamplingParams = SamplingParams()) -> Tuple[List[int], List[Step]]:
    return linked_head.run(engine, mode, PROMPT, max_tokens, sampling)


# -- the pair and the drafter's kind -----------------------------------------------------------------
def test_the_drafter_kind_comes_from_the_gguf_architecture(random_pair, random_engine) -> None:
    target, assistant = random_pair
    assert architecture(str(target)) == "gemma4" and architecture(str(assistant)) == "gemma4-assistant"
    assert is_assistant(str(assistant)) and not is_assistant(str(target))
    assert set(random_engine.drafters) == {"mtp", "lookup", "suffix"}  # no standalone draft model
    info = random_engine.model_info()["draft"]
    assert info["architecture"] == "gemma4-assistant" and info["drafter"] == "mtp"
    assert info["path"] == str(assistant) and info["n_embd_target"] == 64


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
