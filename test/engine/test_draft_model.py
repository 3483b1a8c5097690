"""The draft-model drafter on its own, on a tiny GGUF pair (real llama.cpp, F32 random weights).

Reference: the draft model's own logits for the whole sequence, from one batch decode
(``support.tiny_gguf.logits_of``); F32 weights give the same logits at any batch size, so the drafter's
incremental, KV-reusing decodes must pick the same tokens.
"""
import numpy as np
import pytest

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.drafters.draft_model import DraftModelDrafter
from gemma_spec_ros.engine.sampling import make_rng
from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from support.maths import softmax
from support.tiny_gguf import EOS_ID, logits_of, tokenize, write_tiny_pair

K = 6


def limits(p_min: float = 0.0, draft_min: int = 0) -> SpecConfig:
    """The spec a step hands the drafter: only p_min and draft_min matter to it."""
    return SpecConfig(draft_max=64, p_min=p_min, draft_min=draft_min)


UNLIMITED = limits()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("draft_model"))


@pytest.fixture(scope="module")
def drafter(pair):
    target_path, draft_path = pair
    target = LlamaModel(ModelConfig(str(target_path), n_ctx=64, n_threads=1))
    drafter = DraftModelDrafter(ModelConfig(str(draft_path), n_ctx=64, n_threads=1), target)
    yield drafter
    drafter.close()
    target.close()


@pytest.fixture(autouse=True)
def greedy(drafter):
    """Every test starts from greedy drafting (a request's sampling comes with begin)."""
    drafter.begin([1])
    yield
    drafter.begin([1])


def greedy_path(draft_path, context, n):
    """The draft model's greedy continuation of ``context`` and its top probability at each step."""
    tokens, top = [], []
    for _ in range(n):
        row = logits_of(draft_path, list(context) + tokens)[-1]
        token = int(np.argmax(row))
        tokens.append(token)
        top.append(float(softmax(row)[token]))
    return tokens, top


def test_greedy_draft_is_the_draft_models_own_continuation(pair, drafter):
    context = tokenize(pair[1], "the robot")
    drafter.begin(context)
    draft = drafter.propose(context, K, UNLIMITED)
    expected, _ = greedy_path(pair[1], context, K)
    assert list(draft.tokens) == expected and draft.probs is None
    drafter.end(context + expected)


def test_kv_cache_is_reused_and_rolled_back_after_a_rejection(pair, drafter):
    """Second step: the target accepted 2 of the drafted tokens and emitted another one; the draft
    model's cache keeps the common prefix and must continue from the new context exactly."""
    context = tokenize(pair[1], "a cat sat")
    drafter.begin(context)
    first = drafter.propose(context, K, UNLIMITED)
    other = next(t for t in range(3, 20) if t != first.tokens[2])  # the target's own choice
    context2 = context + list(first.tokens[:2]) + [other]
    second = drafter.propose(context2, K, UNLIMITED)
    assert drafter.backend.n_past >= len(context2) - 1  # decoded incrementally, from the prefix
    assert list(second.tokens) == greedy_path(pair[1], context2, K)[0]
    # and a context that is not an extension at all (a new request) starts over correctly
    fresh = tokenize(pair[1], "zebra")
    drafter.begin(fresh)
    assert list(drafter.propose(fresh, 3, UNLIMITED).tokens) == greedy_path(pair[1], fresh, 3)[0]


def test_p_min_stops_at_the_first_unconfident_token(pair, drafter):
    context = tokenize(pair[1], "the robot")
    _, top = greedy_path(pair[1], context, K)
    checked = set()
    ordered = sorted(top)
    # thresholds halfway between neighbouring probabilities (rounding differences are ~1e-7)
    thresholds = [(a + b) / 2 for a, b in zip(ordered, ordered[1:]) if b - a > 1e-4]
    for p_min in thresholds + [ordered[-1] + 1e-3]:
        expected = next((i for i, p in enumerate(top) if p < p_min), K)
        drafter.begin(context)
        assert len(drafter.propose(context, K, limits(p_min))) == expected, (p_min, top)
        checked.add(expected)
    assert len(checked) >= 2, top  # the thresholds cut the draft at different lengths
    assert drafter.propose(context, K, limits(1.0)).tokens == ()


def test_n_min_drops_a_short_draft(pair, drafter):
    context = tokenize(pair[1], "the robot")
    _, top = greedy_path(pair[1], context, K)
    # cut after at least one token, halfway below the next larger probability
    p_min = min(top[1:]) + min(b - a for a, b in zip(sorted(top), sorted(top)[1:]) if b > a) / 2
    length = next(i for i, p in enumerate(top) if p < p_min)
    if length == 0:
        p_min, length = 0.0, K
    assert len(drafter.propose(context, K, limits(p_min, length))) == length
    assert drafter.propose(context, K, limits(p_min, length + 1)).tokens == ()


def test_sampled_drafts_carry_the_draft_distribution(pair, drafter):
    """For rejection verification: each token comes with q = the draft model's distribution at its
    position (temperature 1, no filters: softmax of its logits), and p_min does not cut it."""
    context = tokenize(pair[1], "the robot")
    for seed in range(20):  # the first seed whose draft does not end early at EOS
        drafter.begin(context, SamplingParams(temperature=1.0), make_rng(seed))
        draft = drafter.propose(context, 4, limits(0.99))
        if EOS_ID not in draft.tokens:
            break
    assert len(draft.tokens) == 4 and len(draft.probs) == 4
    rows = logits_of(pair[1], context + list(draft.tokens))[len(context) - 1:]
    for token, q, row in zip(draft.tokens, draft.probs, rows):
        assert q.sum() == pytest.approx(1.0) and q[token] > 0
        assert np.allclose(q, softmax(row), atol=2e-4)  # batch vs. one-token rounding
    seeded = []
    for _ in range(2):
        drafter.begin(context, SamplingParams(temperature=1.0), make_rng(seed))
        seeded.append(drafter.propose(context, 4, limits(0.99)).tokens)
    assert seeded[0] == seeded[1] == draft.tokens  # the injected generator decides


def test_draft_stops_at_the_end_of_its_context(pair, drafter):
    n_ctx = drafter.backend.n_ctx  # llama.cpp may pad the requested 64 up
    context = [1] + [4 + i % 20 for i in range(n_ctx - 3)]  # room for 2 more tokens
    drafter.begin(context)
    assert len(drafter.propose(context, K, UNLIMITED)) == 2
