"""EAGLE-3 drafting (engine/drafters/eagle3.py) on tiny gemma4 targets + eagle3 heads written with gguf-py.

Two pairs (test/support/tiny_eagle3.py): a **random** head, right about as often as chance (every
round rejected: the head's cache is rolled back at every step), and an **agreeing** one that
predicts the agreeing target by construction (acceptance ~1: accepted drafts flow through the
catch-up of the head's cache). Both targets are F32 with a 64-token sliding window, so 200-token
generations also run over a wrapped window cache.

The drafter runs in test/support/spec_loop.py's minimal loop (the engine's sampler and verification
functions around one drafter). Tests marked ``exact`` compare tokens with plain decoding and need
llama.cpp's exact build; under the default build they skip here and test/engine/test_exact_build.py
runs them under the exact build.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.drafters.eagle3 import (STASH_ROWS, Eagle3Bindings, Eagle3Drafter,
                                                   HeadMismatchError, is_eagle3_head)
from gemma_spec_ros.engine.errors import EngineError
from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from support.spec_loop import generate
from support.tiny_eagle3 import (random_draft_vocabulary, write_eagle3_head, write_eagle3_pair,
                                 write_probe_head)
from support.tiny_gguf import write_tiny_gguf

N_CTX = 512
LONG = 200  # tokens of the parity runs: past the target's 64-token sliding window, three times
PROMPT = "the robot picks up the red cup. "
GREEDY = SpecConfig(p_min=0.0, adaptive=False)  # every step drafts K (the random head is unsure)
#: measured on the agreeing pair at K = 3, greedy: 1.0 (every drafted token accepted)
AGREEING_ACCEPTANCE_FLOOR = 0.9

Pair = Tuple[Path, Path]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return write_eagle3_pair(tmp_path_factory.mktemp("eagle3"), agreeing=False)


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return write_eagle3_pair(tmp_path_factory.mktemp("eagle3"), agreeing=True)


class Loaded:
    """A target and an EAGLE-3 drafter over it, freed in the right order (the head first)."""

    def __init__(self, pair: Pair, n_batch: int = 512, n_ctx: int = N_CTX) -> None:
        self.target = LlamaModel(ModelConfig(str(pair[0]), n_ctx=n_ctx, n_batch=n_batch, n_threads=1))
        try:
            self.drafter = Eagle3Drafter(ModelConfig(str(pair[1]), n_ctx=n_ctx, n_threads=1), self.target)
        except BaseException:
            self.target.close()
            raise
        self.prompt = self.target.tokenize(PROMPT)

    def run(self, drafted: bool = True, max_tokens: int = LONG, **options: object):
        self.drafter.before_target_pass(drafted)
        return generate(self.target, self.drafter if drafted else None, self.prompt, max_tokens,
                        **options)

    def close(self) -> None:
        self.drafter.close()
        self.target.close()


def loaded(pair: Pair, **options: object) -> Iterator[Loaded]:
    models = Loaded(pair, **options)
    try:
        yield models
    finally:
        models.close()


@pytest.fixture
def random_models(random_pair: Pair) -> Iterator[Loaded]:
    yield from loaded(random_pair)


@pytest.fixture
def agreeing_models(agreeing_pair: Pair) -> Iterator[Loaded]:
    yield from loaded(agreeing_pair)


def head_pos_max(drafter: Eagle3Drafter) -> int:
    import llama_cpp

    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(drafter.head._ctx), 0))


def draft_distributions(models: Loaded, context: Sequence[int], k: int = 3) -> List[np.ndarray]:
    """The head's q at each of ``k`` sampled draft positions after ``context`` (fixed seed)."""
    drafter = models.drafter
    drafter.begin(list(context), SamplingParams(temperature=1.0, seed=5), np.random.default_rng(11))
    draft = drafter.propose(list(context), k, GREEDY)
    drafter.begin(list(context))
    assert draft.probs is not None and len(draft.probs) == k
    return list(draft.probs)


def fresh_distributions(pair: Pair, context: Sequence[int], n_batch: int = 512) -> List[np.ndarray]:
    """:func:`draft_distributions` of a target and head that decode ``context[:-1]`` from nothing."""
    for fresh in loaded(pair, n_batch=n_batch):
        fresh.drafter.before_target_pass(True)
        fresh.target.decode(list(context[:-1]), [len(context) - 2])
        return draft_distributions(fresh, context)
    raise AssertionError("unreachable")


# -- the pair, the bindings, the drafter's kind ------------------------------------------------------
def test_the_head_is_known_by_its_gguf_architecture(random_pair: Pair, random_models: Loaded) -> None:
    target, head = random_pair
    assert is_eagle3_head(str(head)) and not is_eagle3_head(str(target))
    assert not is_eagle3_head(str(head) + ".missing")
    info = random_models.drafter.model_info()
    assert info["architecture"] == "eagle3" and info["drafter"] == "eagle3"
    assert info["path"] == str(head) and info["target_layers"] == [0, 1, 2]
    assert info["n_draft_vocab"] == len(random_draft_vocabulary()) < info["n_vocab"] == 256
    assert np.array_equal(random_models.drafter.head.d2t, random_draft_vocabulary())


def test_the_layer_feature_api_is_bound_by_its_mangled_names(random_models: Loaded) -> None:
    """libllama exports the C++ functions under mangled names; the binding finds each one."""
    bindings = random_models.drafter.head.bindings
    assert bindings.target_layers(random_models.drafter.head._model) == [0, 1, 2]
    for name in Eagle3Bindings._SIGNATURES:
        assert callable(getattr(bindings, name))


def test_a_missing_symbol_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A libllama without one of the functions (another llama.cpp): a reason, no crash (the
    missing name is made up here: the real library has all of them)."""
    signatures = dict(Eagle3Bindings._SIGNATURES, llama_get_embeddings_layer_inp_ith="_Z0nowhere")
    monkeypatch.setattr(Eagle3Bindings, "_SIGNATURES", signatures)
    with pytest.raises(EngineError, match="no llama_get_embeddings_layer_inp_ith .*_Z0nowhere"):
        Eagle3Bindings()


# -- drafting, verification, rollback ----------------------------------------------------------------
def test_drafts_are_proposed_verified_and_rolled_back(random_models: Loaded) -> None:
    """Random weights: nearly every draft is rejected, so the head's cells of each draft chain are
    removed before the next catch-up; after a step the head's cache ends at the chain's last cell."""
    result = random_models.run(max_tokens=60)
    assert len(result.tokens) == 60 and len(result.drafts) >= 55
    assert all(d.source == "eagle3" and len(d) == 3 for d in result.drafts[:-2])
    assert result.acceptance_rate < 0.2, result.acceptance_rate
    target, drafter = random_models.target, random_models.drafter
    context = list(target.kv_tokens) + [result.tokens[-1]]
    drafter.propose(context, 3, GREEDY)
    assert head_pos_max(drafter) == target.n_past + 1  # seed at n_past - 1, then 2 chain cells
    drafter.propose(context, 1, GREEDY)
    assert head_pos_max(drafter) == target.n_past - 1  # the chain's cells were removed


@pytest.mark.parametrize("n_batch", [512, 3])
def test_the_head_cache_follows_every_rollback(random_pair: Pair, n_batch: int) -> None:
    """After many rejected rounds the head drafts what a head that never drafted before would
    draft from the same context (its draft distributions): nothing stale in its cache or its g
    rows. n_batch 3 splits each 4-row verify pass in two target chunks."""
    for models in loaded(random_pair, n_batch=n_batch):
        result = models.run(max_tokens=80)
        assert result.acceptance_rate < 0.2 and len(result.drafts) >= 70
        context = list(models.target.kv_tokens) + [result.tokens[-1]]
        long_run = draft_distributions(models, context)
    fresh = fresh_distributions(random_pair, context)
    for q_long, q_fresh in zip(long_run, fresh):  # bit-identical under the exact build
        np.testing.assert_allclose(q_long, q_fresh, rtol=0, atol=1e-5)


def test_a_new_request_rewrites_the_head_cells_after_the_shared_prefix(random_pair: Pair) -> None:
    """A second prompt that shares a prefix with the first: the target keeps the prefix, the head
    rewrites its cells from where the prompts part, and drafts as a head that saw only the second."""
    for models in loaded(random_pair):
        models.run(max_tokens=40)
        second = models.target.tokenize(PROMPT + "then it puts the cup down.")
        models.drafter.before_target_pass(True)
        result = generate(models.target, models.drafter, second, 30)
        context = list(models.target.kv_tokens) + [result.tokens[-1]]
        long_run = draft_distributions(models, context)
    for q_long, q_fresh in zip(long_run, fresh_distributions(random_pair, context)):
        np.testing.assert_allclose(q_long, q_fresh, rtol=0, atol=1e-5)


def test_features_of_undrafted_passes_are_kept(random_pair: Pair) -> None:
    """Passes the policy does not draft still extend the context: their features wait in the stash
    (encoded once it is full), and the next draft is a fresh head's over the same context."""
    for models in loaded(random_pair):
        target, drafter = models.target, models.drafter
        drafter.before_target_pass(True)
        target.decode(models.prompt, [len(models.prompt) - 1])
        token = 40
        for _ in range(STASH_ROWS + 20):  # one-row passes with no draft
            target.decode([token], [0])
            token = 3 + (token * 7) % 200
        context = list(target.kv_tokens) + [token]
        long_run = draft_distributions(models, context)
    for q_long, q_fresh in zip(long_run, fresh_distributions(random_pair, context, n_batch=64)):
        np.testing.assert_allclose(q_long, q_fresh, rtol=0, atol=1e-5)


@pytest.mark.parametrize("feature", [0, 2])
@pytest.mark.parametrize("n_batch", [512, 3])
def test_each_feature_is_the_targets_state_at_the_seed_position(random_pair: Pair, tmp_path: Path,
                                                                feature: int, n_batch: int) -> None:
    """Probe heads whose first draft token shows one feature (test/support/tiny_eagle3.py): the
    input of layer 0 at position n_past - 1 gives the context's token there, the final post-norm
    state gives the target's greedy token after it, which is the pending token. Checked at every
    step of a generation whose drafts are rejected (draft token 2 repeats token 1)."""
    head = write_probe_head(tmp_path / f"probe-{feature}.gguf", random_pair[0], feature)
    seen: List[Tuple[int, int]] = []
    for models in loaded((random_pair[0], head), n_batch=n_batch):
        drafter, real_propose = models.drafter, models.drafter.propose

        def propose(context, max_tokens, spec):  # the real proposal, its first token recorded
            draft = real_propose(context, max_tokens, spec)
            seen.append((draft.tokens[0], context[-1] if feature == 2 else context[-2]))
            return draft

        drafter.propose = propose
        models.run(max_tokens=60)
    assert len(seen) >= 55 and all(first == expected for first, expected in seen), seen


def test_the_agreeing_pair_accepts_nearly_every_draft(agreeing_models: Loaded) -> None:
    """Accepted drafts flow through the head's catch-up (its cells of accepted positions are
    written from the target's features); the output is plain decoding's (the agreeing target's
    margins are far above any rounding, so this holds under either build)."""
    reference = agreeing_models.run(drafted=False)
    result = agreeing_models.run(spec=SpecConfig(p_min=0.75, adaptive=False))
    assert result.tokens == reference.tokens and len(result.tokens) == LONG
    assert result.acceptance_rate > AGREEING_ACCEPTANCE_FLOOR, result.acceptance_rate
    drafts = len(result.drafts)
    assert min(result.accepted_at) > AGREEING_ACCEPTANCE_FLOOR * drafts, result.accepted_at
    assert result.passes < LONG / 3  # ~4 tokens per target pass


def test_tokens_a_grammar_forces_are_fed_before_the_head_drafts(agreeing_models: Loaded) -> None:
    """Under a grammar the engine drafts the forced text first and asks the drafter to continue
    after it: the head takes the forced tokens as its own chain, then drafts on from there."""
    from support.tiny_gemma4 import successor_cycle

    succ = successor_cycle()
    target, drafter = agreeing_models.target, agreeing_models.drafter
    drafter.before_target_pass(True)
    prompt = agreeing_models.prompt
    pending = int(succ[prompt[-1]])
    target.decode(prompt, [len(prompt) - 1])
    forced = [int(succ[pending]), int(succ[succ[pending]])]
    draft = drafter.propose(prompt + [pending] + forced, 3, GREEDY)
    expected, token = [], forced[-1]
    for _ in range(3):
        token = int(succ[token])
        expected.append(token)
    assert list(draft.tokens) == expected
    assert head_pos_max(drafter) == target.n_past + len(forced) + 1
    assert list(drafter.propose(prompt + [pending], 3, GREEDY).tokens) == forced + expected[:1]


def test_rejection_verification_uses_the_head_distribution(agreeing_models: Loaded) -> None:
    """Sampled requests under ``rejection``: the drafts are sampled, with q over the whole
    vocabulary that is 0 outside the head's draft vocabulary, and verified."""
    result = agreeing_models.run(max_tokens=60, sampling=SamplingParams(temperature=0.7, seed=3),
                                 rejection=True)
    assert len(result.tokens) == 60 and result.drafts
    d2t = agreeing_models.drafter.head.d2t
    outside = np.setdiff1d(np.arange(256), d2t)
    for draft in result.drafts:
        assert draft.probs is not None and len(draft.probs) == len(draft.tokens)
        for token, q in zip(draft.tokens, draft.probs):
            assert abs(float(q.sum()) - 1.0) < 1e-6 and q[token] > 0 and not q[outside].any()
    assert result.acceptance_rate > 0.5, result.acceptance_rate  # q close to p: most accepted


def test_features_are_exported_only_while_the_drafter_may_draft(agreeing_models: Loaded,
                                                                random_pair: Pair,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a head, or with it switched off, the target exports nothing and runs no hook;
    switching costs one llama.cpp call per feature (a spy counts the real calls)."""
    target, drafter = agreeing_models.target, agreeing_models.drafter
    bindings = drafter.head.bindings
    calls: List[Tuple[int, bool]] = []
    real = bindings.llama_set_embeddings_layer_inp
    monkeypatch.setattr(bindings, "llama_set_embeddings_layer_inp",
                        lambda ctx, layer, on: calls.append((layer, on)) or real(ctx, layer, on))
    assert not drafter.features.enabled and not target.chunk_listeners
    agreeing_models.run(drafted=False, max_tokens=8)
    assert calls == [] and not target.chunk_listeners
    agreeing_models.run(max_tokens=8)
    assert calls == [(0, True), (1, True)]  # layer 2 = the target's n_layer: the post-norm export
    assert drafter.features.enabled and bool(target.chunk_listeners)
    agreeing_models.run(max_tokens=8)
    assert len(calls) == 2  # already on
    drafter.before_target_pass(False)
    assert calls[2:] == [(0, False), (1, False)] and not target.chunk_listeners
    plain = LlamaModel(ModelConfig(str(random_pair[0]), n_ctx=N_CTX, n_threads=1))
    try:
        assert not plain.chunk_listeners
    finally:
        plain.close()


def test_switched_off_and_on_while_generating(agreeing_models: Loaded) -> None:
    """Off for a few passes (the target then exports nothing), on again: the head starts over at
    the next pass and drafts from the one after; the output stays plain decoding's."""
    reference = agreeing_models.run(drafted=False, max_tokens=80)
    drafter, real_propose = agreeing_models.drafter, agreeing_models.drafter.propose
    sizes: List[int] = []

    def propose(context, max_tokens, spec):  # the real drafter, switched off for passes 10..19
        step = len(sizes)
        drafter.before_target_pass(not 10 <= step < 20)
        draft = real_propose(context, max_tokens, spec)
        sizes.append(len(draft))
        return draft

    drafter.propose = propose
    try:
        result = agreeing_models.run(max_tokens=80)
    finally:
        del drafter.propose
    assert result.tokens == reference.tokens
    assert set(sizes[:10]) == {3} and set(sizes[10:21]) == {0}  # pass 20: no features yet
    assert set(sizes[21:-2]) == {3}


def test_warm_up_leaves_the_head_ready(agreeing_models: Loaded) -> None:
    """Calibration runs the head's passes untimed; the next request drafts as before."""
    drafter = agreeing_models.drafter
    first = agreeing_models.run(max_tokens=40)
    drafter.warm_up(list(range(3, 60)), 9, 2)
    assert head_pos_max(drafter) == -1
    again = agreeing_models.run(max_tokens=40)
    assert again.tokens == first.tokens and again.acceptance_rate == first.acceptance_rate == 1.0


# -- lossless: token for token what plain decoding emits ---------------------------------------------
@pytest.mark.exact
@pytest.mark.timeout(300)
def test_greedy_eagle3_equals_plain_token_for_token(exact_build, random_models: Loaded) -> None:
    reference = random_models.run(drafted=False)
    result = random_models.run()
    assert len(reference.tokens) == LONG and result.tokens == reference.tokens
    assert len(result.drafts) > LONG / 2


@pytest.mark.exact
@pytest.mark.timeout(300)
def test_seeded_sampling_eagle3_equals_plain(exact_build, random_models: Loaded) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    reference = random_models.run(drafted=False, sampling=sampling)
    result = random_models.run(sampling=sampling)
    assert len(reference.tokens) == LONG and result.tokens == reference.tokens
    assert len(result.drafts) > LONG / 2
    other = random_models.run(drafted=False, sampling=SamplingParams(temperature=0.9, top_k=40, seed=99))
    assert other.tokens != reference.tokens  # the seed matters: the equality above is not vacuous


# -- refusals at load --------------------------------------------------------------------------------
def load_pair(target: Path, head: Path, head_n_ctx: int = N_CTX) -> None:
    """Load the head for the target, free both; the refusal under test raises in between."""
    backend = LlamaModel(ModelConfig(str(target), n_ctx=N_CTX, n_threads=1))
    try:
        Eagle3Drafter(ModelConfig(str(head), n_ctx=head_n_ctx, n_threads=1), backend).close()
    finally:
        backend.close()


def test_a_file_that_is_no_eagle3_head_is_refused(random_pair: Pair) -> None:
    target, _ = random_pair
    with pytest.raises(HeadMismatchError, match="no EAGLE-3 head: its architecture is gemma4"):
        load_pair(target, target)


def test_a_target_without_a_feature_export_is_refused_without_asking_it(
        random_pair: Pair, tmp_path: Path) -> None:
    """Gemma 3's graph publishes no layer inputs: asking it to export them would abort the
    process (a failed assertion in llama.cpp). Its features come from an eval callback set when its
    context is created: a gemma3 target loaded without one is refused first, saying what it needs."""
    gemma3 = write_tiny_gguf(tmp_path / "gemma3.gguf", vocab_size=256, n_embd=64, n_layer=2, arch="gemma3")
    with pytest.raises(HeadMismatchError, match="is gemma3, whose features are copied .* loaded without it"):
        load_pair(gemma3, random_pair[1])


@pytest.mark.parametrize("head_options, message", [
    (dict(hidden_size=32), "reads target features of size 32, and the target .* has 64"),
    (dict(n_embd=32), "has a hidden size of 32, and the target .* has 64"),
    (dict(layers=(0, 1, 5)), r"reads target layers \[0, 1, 5\], and the target .* has 2 layers"),
    (dict(vocab_size=200), "vocabulary of 200 tokens .* 256"),
])
def test_a_head_of_another_target_is_refused(random_pair: Pair, tmp_path: Path, head_options: dict,
                                             message: str) -> None:
    head = write_eagle3_head(tmp_path / "other-head.gguf", **head_options)
    with pytest.raises(HeadMismatchError, match=message):
        load_pair(random_pair[0], head)


def test_an_n_ctx_unlike_the_targets_is_refused(random_pair: Pair) -> None:
    with pytest.raises(HeadMismatchError, match=r"n_ctx \(256\) must be the target's \(512\)"):
        load_pair(*random_pair, head_n_ctx=256)


def test_the_agreeing_target_is_what_the_head_construction_assumes(agreeing_pair: Pair) -> None:
    """The helper's claim the acceptance test rests on: next token = succ(current token)."""
    from support.tiny_gemma4 import successor_cycle
    from support.tiny_gguf import logits_of

    succ = successor_cycle()
    tokens = [1, 40, 41, 77, 200, 9]
    rows = logits_of(agreeing_pair[0], tokens)
    assert [int(r.argmax()) for r in rows[1:]] == [int(succ[t]) for t in tokens[1:]]
