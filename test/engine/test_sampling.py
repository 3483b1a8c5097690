"""The sampler (engine/sampling.py) on scripted logits: greedy, temperature, top-k/top-p/min-p.

Fakes here are chosen distributions (support/logits.py): no real model can be made to produce a
given distribution, and the statistical checks need exactly known ones.
"""
import numpy as np
import pytest

from gemma_spec_ros.engine.sampling import Sampler, make_rng
from gemma_spec_ros.engine.config import SamplingParams
from support.logits import logits_of
from support.maths import softmax
from support.stats import chi_square_p_value


def test_greedy_takes_argmax_and_no_random_number():
    rng = make_rng(1)
    state = rng.bit_generator.state
    assert Sampler(SamplingParams()).sample(np.array([0.0, 3.0, 1.0], np.float32), rng) == 1
    assert rng.bit_generator.state == state


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_a_denormal_temperature_samples_the_most_likely_token(temperature):
    """Regression: logits / 1e-310 overflowed to inf and the softmax gave NaN."""
    logits = np.array([3.0, 7.5, -2.0, 7.0], dtype=np.float32)
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.9)):
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1))
        assert [sampler.sample(logits, make_rng(seed)) for seed in range(5)] == [1] * 5


def test_seeded_sampling_is_reproducible_and_follows_temperature():
    logits = logits_of([0.5, 0.3, 0.2])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = [sampler.sample(logits, make_rng(3)) for _ in range(3)]
    assert len(set(draws)) == 1
    rng = make_rng(7)
    counts = np.bincount([sampler.sample(logits, rng) for _ in range(4000)], minlength=3)
    assert chi_square_p_value(counts, [0.5, 0.3, 0.2]) > 1e-3


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_follows_softmax_of_logits_over_temperature(temperature):
    """T != 1 against the known distribution softmax(logits / T), not the sampler against itself
    (sharper at T = 0.5, flatter at T = 2: each differs from T = 1 beyond the test's power)."""
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    expected = softmax(logits.astype(np.float64) / temperature)
    sampler = Sampler(SamplingParams(temperature=temperature))
    assert np.allclose(sampler.distribution(logits), expected, atol=1e-6)
    rng = make_rng(11)
    counts = np.bincount([sampler.sample(logits, rng) for _ in range(4000)], minlength=4)
    assert chi_square_p_value(counts, expected) > 1e-3
    assert chi_square_p_value(counts, [0.5, 0.3, 0.15, 0.05]) < 1e-6  # T = 1 is told apart


def test_top_k_top_p_min_p_filters():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert np.allclose(Sampler(SamplingParams(temperature=1.0, top_k=2)).distribution(logits),
                       [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(Sampler(SamplingParams(temperature=1.0, top_p=0.65)).distribution(logits),
                       [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(Sampler(SamplingParams(temperature=1.0, min_p=0.6)).distribution(logits),
                       [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(Sampler(SamplingParams(temperature=1.0)).distribution(logits), [0.4, 0.3, 0.2, 0.1],
                       atol=1e-6)


def test_nucleus_on_a_large_vocabulary_uses_the_full_mass():
    # 4096 tokens of equal weight: the first 1024 candidates hold 1/4 of the mass, so a top_p of
    # 0.5 must look beyond them (and keep 2048 tokens).
    logits = np.zeros(4096, dtype=np.float32)
    dist = Sampler(SamplingParams(temperature=1.0, top_p=0.5)).distribution(logits)
    assert np.count_nonzero(dist) == 2048
    assert dist.sum() == pytest.approx(1.0)
