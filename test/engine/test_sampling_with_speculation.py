"""Engine tests on tiny random-weight GGUF pairs (same vocabulary of 32 tokens, written with `gguf`).

The tiny F32 models are small enough that we can compute the target's exact distributions over
whole token sequences, and llama.cpp's kernels give them the same logits for any batch size.
"""
import numpy as np
import pytest

from dataclasses import replace

from gemma_spec_ros.engine.config import SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine, collect
from support.maths import softmax
from support.stats import chi_square_p_value
from support.tiny_gguf import EOS_ID, write_tiny_pair

ALPHA = 1e-3  # significance level of each goodness-of-fit test (fixed seeds: deterministic outcome)
PROMPT = "ab"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("tiny"))


def make_engine(tiny_pair, **spec):
    target, draft = tiny_pair
    return build_engine(target, draft, n_threads=1, calibrate=True, spec=SpecConfig(**spec))


def exact_marginals(engine, prompt_tokens):
    """P(t1), P(t2), P(t3) of the target at temperature 1 (EOS ends the sequence: later positions
    are then the extra category ``vocab`` = 'no token')."""
    backend = engine.target
    vocab = backend.n_vocab

    def next_dist(tokens):
        backend.clear()
        return softmax(backend.decode(tokens, [len(tokens) - 1])[0].astype(np.float64))

    p1 = np.append(next_dist(prompt_tokens), 0.0)
    p2 = np.zeros(vocab + 1)
    p3 = np.zeros(vocab + 1)
    p2[vocab] = p3[vocab] = p1[EOS_ID]
    for t1 in range(vocab):
        if t1 == EOS_ID or p1[t1] == 0:
            continue
        d2 = next_dist(prompt_tokens + [t1])
        p2[:vocab] += p1[t1] * d2
        p3[vocab] += p1[t1] * d2[EOS_ID]
        for t2 in range(vocab):
            if t2 != EOS_ID:
                p3[:vocab] += p1[t1] * d2[t2] * next_dist(prompt_tokens + [t1, t2])
    backend.clear()
    return p1, p2, p3


def observed_position(tokens, i, vocab):
    """Token at position i as the marginals count it: EOS if the sequence ended right there."""
    if len(tokens) > i:
        return tokens[i]
    return EOS_ID if len(tokens) == i else vocab


@pytest.mark.timeout(300)
def test_rejection_sampling_matches_the_target_distribution(tiny_pair):
    engine = make_engine(tiny_pair, mode="draft", draft_max=2, adaptive=False, verification="rejection",
                         p_min=0.0)
    try:
        prompt_tokens = engine.prompt_tokens(GenerationRequest(PROMPT))
        vocab = engine.target.n_vocab
        p1, p2, p3 = exact_marginals(engine, prompt_tokens)
        n = 3000
        counts = np.zeros((3, vocab + 1))
        accepted = drafted = 0
        for seed in range(n):
            request = GenerationRequest(PROMPT, max_tokens=3, sampling=SamplingParams(temperature=1.0, seed=seed))
            done = collect(engine, request)
            tokens = done.tokens
            accepted += done.stats.num_accepted_tokens
            drafted += done.stats.num_draft_tokens
            for i in range(3):
                counts[i, observed_position(tokens, i, vocab)] += 1
        assert drafted > n / 2, "rejection path barely exercised"
        assert 0 < accepted < drafted  # both acceptance and residual resampling happened
        for position, expected in enumerate((p1, p2, p3)):
            p_value = chi_square_p_value(counts[position], expected)
            assert p_value > ALPHA, f"token {position + 1}: p = {p_value:.2g}"
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_seeded_sampling_is_identical_with_and_without_speculation(tiny_pair):
    engine = make_engine(tiny_pair, mode="off", draft_max=4, adaptive=False, p_min=0.0)
    try:
        for seed in (1, 2, 3):
            sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
            outputs = {}
            for mode in ("off", "draft", "lookup", "draft+lookup", "auto"):
                done = collect(engine, GenerationRequest(PROMPT, max_tokens=200, sampling=sampling,
                                                         spec_mode=mode))
                outputs[mode] = done.tokens
                if mode != "off":  # else parity would be vacuous
                    assert done.stats.num_drafts > 0, f"seed {seed}: {mode} never drafted"
            for mode, tokens in outputs.items():
                assert tokens == outputs["off"], f"seed {seed}: {mode} differs from off"
    finally:
        engine.close()


def generate(engine, request):
    done = collect(engine, request)
    return done.tokens, done.text, done.steps


@pytest.fixture(scope="module")
def tiny_engine(tiny_pair):
    engine = make_engine(tiny_pair, mode="off", draft_max=4, adaptive=False, p_min=0.0)
    yield engine
    engine.close()


def test_eos_ends_the_generation_with_stop(tiny_engine):
    """A sampled sequence of the tiny model ends with EOS well before 200 tokens: finish_reason
    is stop, and EOS itself is neither emitted nor in the text."""
    finished = []
    for seed in range(5):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        tokens, text, steps = generate(tiny_engine, GenerationRequest(PROMPT, max_tokens=200,
                                                                      sampling=sampling,
                                                                      spec_mode="draft"))
        assert EOS_ID not in tokens and "</s>" not in text
        finished.append(steps[-1].finish_reason)
        if steps[-1].finish_reason == "stop":
            assert len(tokens) < 200 and steps[-1].stats.num_generated_tokens == len(tokens)
    assert "stop" in finished, finished


def test_seed_minus_one_draws_fresh_randomness(tiny_engine):
    sampling = SamplingParams(temperature=1.0, seed=-1)
    outputs = {tuple(generate(tiny_engine, GenerationRequest(PROMPT, max_tokens=24, sampling=sampling))[0])
               for _ in range(3)}
    assert len(outputs) > 1
    seeded = SamplingParams(temperature=1.0, seed=8)
    same = {tuple(generate(tiny_engine, GenerationRequest(PROMPT, max_tokens=24, sampling=seeded))[0])
            for _ in range(2)}
    assert len(same) == 1


def test_spec_adaptive_switched_at_runtime(tiny_engine):
    """adaptive off: every step drafts K. Switched on while drafting is (made) far too expensive,
    the policy stops drafting from the next step until its first probe (8 plain steps later).

    The draft cost is injected into the engine's cost model (10 s a token): measured costs on a
    tiny model are timing noise, and the test needs a policy decision that cannot flip."""
    spec = tiny_engine.spec
    tiny_engine.costs.observe_draft_time("draft", 1, 10.0)
    request = GenerationRequest(PROMPT, max_tokens=60, spec_mode="draft")  # greedy
    tiny_engine.update_spec(replace(spec, adaptive=False))
    drafts = []
    try:
        for i, step in enumerate(tiny_engine.generate(request)):
            drafts.append(step.stats.num_drafts)
            if i == 6:
                tiny_engine.update_spec(replace(spec, adaptive=True))
    finally:
        tiny_engine.update_spec(spec)
    assert len(drafts) > 14, "the request ended too early (EOS)"
    assert drafts[1:7] == [1, 2, 3, 4, 5, 6]  # adaptive off: a draft at every step
    assert drafts[7:14] == [6] * 7  # adaptive on: drafting is off
