"""EAGLE-3 drafting through the real Engine (``spec.mode: eagle3``) on the tiny gemma4 targets +
eagle3 heads of test/support/tiny_eagle3.py: what only the EAGLE-3 head has.

test/engine/test_eagle3.py drives the drafter in a minimal loop; here the engine's own loop drives
it: the kind of drafter comes from the GGUF named by ``draft.model_path``, the head's own cache (its
KV and its g rows) follows every rollback of the engine, and a head made for another target, or a
gemma3 target with a head of its final state, is refused at configure. What EAGLE-3 shares with
MTP (drafts verified and rolled back, acceptance on the agreeing pair, sampled requests, the policy
and ``auto``, output equal to ``off``'s, cancel, runtime switches, grammars, feature export only
while the mode may draft with the head, the common refusals) runs for both kinds in
test/engine/test_linked_heads.py.

The **random** head here drafts nearly always wrong: the head's cache is rolled back at every step.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.drafters.eagle3 import Eagle3Drafter, HeadMismatchError
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import EngineError
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.request import Step
from support import linked_head
from support.engine import build_engine
from support.tiny_eagle3 import write_eagle3_head, write_eagle3_pair
from support.tiny_gguf import write_tiny_gguf

N_CTX = 512
PROMPT = "the robot picks up the red cup. "
K = 3

Pair = Tuple[Path, Path]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return write_eagle3_pair(tmp_path_factory.mktemp("eagle3"), agreeing=False)


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


def run(engine: Engine, mode: str, max_tokens: int, prompt: str = PROMPT) -> Tuple[List[int], List[Step]]:
    return linked_head.run(engine, mode, prompt, max_tokens)


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


# -- the head's own cache ----------------------------------------------------------------------------
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

