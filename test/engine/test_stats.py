"""The speculation statistics (engine/stats.py): their conventions on a worked example."""
import math

import pytest

from gemma_spec_ros.engine.stats import FORCED_SOURCE, SOURCE_KINDS, SpecStats, source_kind


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


def test_acceptance_histogram_and_tokens_by_source_worked_example():
    """vLLM's per-request summary on the worked example: h[i] = passes that accepted i drafted
    tokens; sum(h) = drafts, sum(i * h[i]) = accepted. A draft's forced prefix counts under the
    grammar, the rest under its drafter."""
    stats = SpecStats()
    for drafted, accepted in ((4, 4), (4, 1), (4, 0)):
        stats.observe_draft(drafted, accepted, "lookup")
    assert stats.acceptance_histogram == [1, 1, 0, 0, 1]
    stats.observe_draft(0, 0, "lookup")  # an empty draft is no verify pass with a draft
    assert stats.acceptance_histogram == [1, 1, 0, 0, 1]
    stats.observe_draft(6, 3, "mtp", num_forced=2)  # 2 forced (both accepted), 4 drafted (1 accepted)
    stats.observe_draft(3, 1, FORCED_SOURCE, num_forced=3)  # forced whole
    stats.observe_draft(2, 0, "suffix")
    assert stats.acceptance_histogram == [2, 2, 0, 1, 1, 0, 0]
    h = stats.acceptance_histogram
    assert sum(h) == stats.num_drafts == 6
    assert sum(i * n for i, n in enumerate(h)) == stats.num_accepted_tokens == 9
    assert stats.draft_tokens_by_source == {"lookup": 12, "grammar": 5, "mtp": 4, "suffix": 2}
    assert stats.accepted_tokens_by_source == {"lookup": 5, "grammar": 3, "mtp": 1, "suffix": 0}
    assert (stats.num_grammar_draft_tokens, stats.num_grammar_accepted_tokens) == (5, 3)
    assert stats.tokens_by_kind() == {"lookup": (12, 5), "suffix": (2, 0), "model": (4, 1), "grammar": (5, 3)}
    values = stats.as_dict()
    assert values["acceptance_histogram"] == h
    assert (values["num_model_draft_tokens"], values["num_model_accepted_tokens"]) == (4, 1)
    assert (values["num_lookup_draft_tokens"], values["num_suffix_draft_tokens"]) == (12, 2)
    assert stats.drafts_by_source == {"lookup": 3, "mtp": 1, "grammar": 1, "suffix": 1}  # unchanged meaning


def test_merge_adds_histograms_of_different_lengths_and_sources():
    short, long = SpecStats(), SpecStats()
    short.observe_draft(1, 1, "lookup")
    short.observe_draft(2, 0, "draft", num_forced=1)
    long.observe_draft(5, 5, "lookup")
    long.observe_draft(3, 2, "suffix")
    short.num_grammar_sole_rows, long.num_grammar_sole_rows = 2, 3
    frozen = short.snapshot()
    total = SpecStats()
    for part in (short, long):
        total.merge(part)
    assert total.acceptance_histogram == [1, 1, 1, 0, 0, 1]
    assert total.draft_tokens_by_source == {"lookup": 6, "grammar": 1, "draft": 1, "suffix": 3}
    assert total.accepted_tokens_by_source == {"lookup": 6, "grammar": 0, "draft": 0, "suffix": 2}
    assert total.num_grammar_sole_rows == 5
    assert sum(total.acceptance_histogram) == total.num_drafts == 4
    assert sum(i * n for i, n in enumerate(total.acceptance_histogram)) == total.num_accepted_tokens
    long.merge(short)  # the longer histogram keeps its length
    assert long.acceptance_histogram == [1, 1, 1, 0, 0, 1]
    short.observe_draft(3, 3, "lookup")  # a snapshot is independent of what follows
    assert frozen.acceptance_histogram == [1, 1, 0] and frozen.draft_tokens_by_source["lookup"] == 1


def test_every_drafter_counts_under_one_kind_of_source():
    """lookup, suffix, model (the drafters that run draft.model_path's model) and the grammar's forced
    text: the message's num_<kind>_draft_tokens add up to num_draft_tokens."""
    from gemma_spec_ros.engine.drafter_kinds import is_model_kind
    from gemma_spec_ros.engine.modes import MODES
    from gemma_spec_ros.engine.propose import GRAMMAR_SOURCE

    assert GRAMMAR_SOURCE == FORCED_SOURCE
    names = {name for mode in MODES.values() for name in mode.chain}
    assert {name: source_kind(name) for name in names} == {
        name: name if name in ("lookup", "suffix") else "model" for name in names}
    assert {name for name in names if source_kind(name) == "model"} == {name for name in names if is_model_kind(name)}
    assert source_kind(GRAMMAR_SOURCE) == "grammar" and SOURCE_KINDS == ("lookup", "suffix", "model", "grammar")
