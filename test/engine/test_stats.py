"""The speculation statistics (engine/stats.py): their conventions on a worked example."""
import math

import pytest

from gemma_spec_ros.engine.stats import SpecStats


def test_stats_conventions_worked_example():
    stats = SpecStats()
    for drafted, accepted in ((4, 4), (4, 1), (4, 0)):
        stats.observe_draft(drafted, accepted, "lookup")
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert stats.acceptance_rate == pytest.approx(5 / 12)
    assert stats.acceptance_per_position == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert stats.drafts_by_source == {"lookup": 3}
    with pytest.raises(ValueError):
        stats.observe_draft(2, 3)
    total = SpecStats()
    total.merge(stats)
    total.merge(stats)
    assert total.num_drafts == 6 and total.mean_acceptance_length == stats.mean_acceptance_length
    assert math.isnan(SpecStats().mean_acceptance_length)
