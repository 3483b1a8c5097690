"""Verification of a draft (engine/sampling.py) on scripted logits: exact and rejection sampling.

Fakes here are chosen distributions (support/logits.py): no real model can be made to produce a
given p and q, and the statistical checks need exactly known ones.
"""
import numpy as np
import pytest

from gemma_spec_ros.engine.sampling import Sampler, make_rng, verify_exact, verify_rejection
from gemma_spec_ros.engine.config import SamplingParams

from support.logits import logits_of, one_hot_rows
from support.stats import chi_square_p_value


def test_verify_exact_worked_example():
    verdict = verify_exact(one_hot_rows((7, 3, 4, 2)), (7, 3, 9), Sampler(SamplingParams()), make_rng(0))
    assert verdict.tokens == (7, 3, 4) and verdict.num_accepted == 2


def test_verify_exact_full_accept_gives_bonus_and_reject_first():
    sampler = Sampler(SamplingParams())
    full = verify_exact(one_hot_rows((1, 2, 3)), (1, 2), sampler, make_rng(0))
    assert full.tokens == (1, 2, 3) and full.num_accepted == 2
    none = verify_exact(one_hot_rows((5, 2)), (1,), sampler, make_rng(0))
    assert none.tokens == (5,) and none.num_accepted == 0
    with pytest.raises(ValueError):
        verify_exact(one_hot_rows((1,)), (1,), sampler, make_rng(0))


def test_verify_exact_consumes_one_random_number_per_emitted_token():
    # Same rows, same seed: the tokens verify_exact emits are those of sampling row by row.
    rng_rows = np.random.default_rng(5)
    rows = [rng_rows.normal(size=50).astype(np.float32) for _ in range(4)]
    sampler = Sampler(SamplingParams(temperature=0.8))
    plain_rng = make_rng(11)
    plain = [sampler.sample(row, plain_rng) for row in rows]
    verdict = verify_exact(rows, tuple(plain[:3]), sampler, make_rng(11))
    assert verdict.tokens == tuple(plain) and verdict.num_accepted == 3


@pytest.mark.parametrize("draft_probs", ["model", "point"])
def test_verify_rejection_preserves_the_target_distribution(draft_probs):
    """Leviathan/Chen: the first emitted token is distributed as p whatever q is (alpha = 0.001)."""
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.1, 0.6, 0.1, 0.2])
    sampler = Sampler(SamplingParams(temperature=1.0))
    rows = [logits_of(p), logits_of(p)]
    rng = make_rng(2024)
    counts = np.zeros(4)
    accepted = 0
    for _ in range(6000):
        x = int(rng.choice(4, p=q)) if draft_probs == "model" else 1
        verdict = verify_rejection(rows, (x,), (q,) if draft_probs == "model" else None, sampler, rng)
        counts[verdict.tokens[0]] += 1
        accepted += verdict.num_accepted
    assert chi_square_p_value(counts, p) > 1e-3
    # acceptance probability is sum_x min(p, q) for a model draft, p(x) for a point mass
    expected = np.minimum(p, q).sum() if draft_probs == "model" else p[1]
    assert accepted / 6000 == pytest.approx(expected, abs=0.03)
