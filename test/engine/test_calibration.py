"""Calibration on a shared host: a burst of load during one timed pass must not stay in the cost
shape (a 5-row pass measured at 2.8 V(1) instead of ~2.2 kept the policy from
drafting 4 tokens for a whole run).

The target here is a fake whose pass times we script: no real model can be made to run one chosen
pass slowly. The real calibration on the real models is covered by test_engine_on_real_models.py
(test_calibration_warms_up_and_leaves_both_caches_empty)."""
from typing import List, Sequence, Tuple

import pytest

from gemma_spec_ros.engine.policy.calibration import measure_costs, non_decreasing
from gemma_spec_ros.engine.policy.costs import CostModel


class ScriptedTarget:
    """A target whose n-row pass takes ``base[n]`` seconds, except timed passes listed in ``bursts``
    (by their order among all timed passes), which take ``burst`` seconds more."""

    n_ctx, n_vocab, bos = 512, 1000, 2

    def __init__(self, base: dict, bursts: Sequence[int], burst: float = 1.0) -> None:
        self.base, self.bursts, self.burst = base, set(bursts), burst
        self.timed: List[int] = []  # rows of each timed pass, in order

    def clear(self) -> None:
        pass

    def decode(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> list:
        return []

    def rollback(self, n_past: int) -> None:
        pass

    def timed_decode(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> Tuple[list, float]:
        index = len(self.timed)
        self.timed.append(len(tokens))
        return [], self.base[len(tokens)] + (self.burst if index in self.bursts else 0.0)


BASE = {n: 0.020 + 0.010 * (n - 1) for n in range(1, 10)}


def test_sizes_are_timed_in_rounds_and_a_burst_costs_one_pass_not_the_figure() -> None:
    # the burst lasts three timed passes in a row: timed size by size (the old way), all of a size's
    # repeats would fall in it
    target = ScriptedTarget(BASE, bursts=(12, 13, 14))
    costs = CostModel()
    measured = measure_costs(target, [], costs, draft_max=8, repeats=3)
    assert target.timed[:18] == list(range(1, 10)) * 2  # round after round over every size
    assert measured == pytest.approx(BASE)
    assert costs.verify_cost(5) == pytest.approx(BASE[5])


def test_a_size_measured_dearer_than_the_next_is_pooled_with_it() -> None:
    # every repeat of size 5 is slow (a burst as long as the whole calibration hits only size 5 here)
    target = ScriptedTarget(BASE, bursts=[i for i in range(27) if i % 9 == 4], burst=0.030)
    measured = measure_costs(target, [], CostModel(), draft_max=8, repeats=3)
    assert measured[5] == measured[6] == pytest.approx((BASE[5] + 0.030 + BASE[6]) / 2)
    assert [measured[n] for n in range(1, 10)] == sorted(measured[n] for n in range(1, 10))


def test_non_decreasing_keeps_a_monotone_profile_and_pools_violators() -> None:
    assert non_decreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
    assert non_decreasing([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert non_decreasing([]) == []
