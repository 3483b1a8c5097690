"""``draft+lookup`` vs ``auto``: the same two drafters, tried in a different order.

- ``draft+lookup``: a fixed chain, n-gram first, then the draft model; honours ``spec.adaptive``.
- ``auto``: always adaptive; the drafter with the best predicted speedup first, or none.

Pure: scripted costs and acceptance, no model (the engine's loop is tested on real GGUF files).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

from gemma_spec_ros.engine.drafters import registry
from gemma_spec_ros.engine.modes import MODES, SPEC_MODES, mode_problem
from gemma_spec_ros.engine.policy.costs import CostModel
from gemma_spec_ros.engine.policy.length import DraftLengthPolicy
from gemma_spec_ros.engine.propose import Drafting, drafting_order


def drafters(lookup_accepts: int, rounds: int = 30) -> Dict[str, Drafting]:
    """Both drafters on one measured device: 3-token drafts; the draft model always right and
    costing 1 ms a token, the n-gram drafter free and right on its first ``lookup_accepts`` tokens."""
    costs = CostModel()
    for rows in (1, 2, 3, 4):
        costs.observe_verify(rows, 0.008 + 0.002 * rows)
    costs.observe_draft_time("draft", 3, 0.003)
    costs.observe_draft_time("lookup", 3, 0.0)
    table = {}
    for name, accepted in (("lookup", lookup_accepts), ("draft", 3)):
        policy = DraftLengthPolicy(name, costs)
        for _ in range(rounds):
            policy.observe(3, accepted)
        table[name] = Drafting(SimpleNamespace(name=name), policy)  # the order needs no drafting
    return table


def order(mode: str, table: Dict[str, Drafting], adaptive: bool = True) -> List[Tuple[str, int]]:
    return [(d.drafter.name, decision.draft_len)
            for d, decision, _ in drafting_order(mode, table, 3, adaptive)]


def test_the_mode_table_names_each_mode_once_and_what_it_needs() -> None:
    assert tuple(SPEC_MODES) == tuple(MODES) and all(MODES[name].name == name for name in MODES)
    for mode in MODES.values():  # a mode that needs a drafter tries it; only ranked modes do without
        assert not mode.needs or mode.needs in mode.chain
        assert not mode.needs or registry.is_model_kind(mode.needs)
        assert all(registry.get(name) for name in mode.chain)  # every chain names registered kinds
    assert [m.name for m in MODES.values() if m.ranked] == ["auto"]
    assert mode_problem("auto", loaded=["lookup"]) == ""  # auto runs with whatever is loaded


def test_a_mode_whose_drafter_is_missing_or_of_another_kind_says_so() -> None:
    assert "needs a draft model, and none is loaded" in mode_problem("draft+lookup", ["lookup"])
    assert "needs a Gemma 4 assistant" in mode_problem("mtp", ["lookup", "draft"])
    wrong_kind = mode_problem("draft", ["lookup", "mtp"])
    assert "names a Gemma 4 assistant" in wrong_kind and "'mtp'" in wrong_kind
    assert "expected one of" in mode_problem("warp", ["lookup"])


def test_draft_plus_lookup_is_a_fixed_chain_auto_ranks_by_predicted_speedup() -> None:
    # n-gram drafts right on their first token only: still worth a 1-token draft, but the draft
    # model predicts more
    assert order("draft+lookup", drafters(lookup_accepts=1)) == [("lookup", 1), ("draft", 3)]
    assert order("auto", drafters(lookup_accepts=1)) == [("draft", 3), ("lookup", 1)]
    # the n-gram drafter always right and free: auto tries it first too
    assert order("auto", drafters(lookup_accepts=3)) == [("lookup", 3), ("draft", 3)]


def test_auto_is_always_adaptive() -> None:
    # n-gram drafts always wrong: draft+lookup with a fixed K still tries them, auto never does
    assert order("draft+lookup", drafters(lookup_accepts=0), adaptive=False) == [("lookup", 3), ("draft", 3)]
    assert order("auto", drafters(lookup_accepts=0), adaptive=False) == [("draft", 3)]
    assert order("draft+lookup", drafters(lookup_accepts=0), adaptive=True) == [("draft", 3)]


def test_auto_without_a_draft_model_uses_the_lookup_drafter() -> None:
    table = drafters(lookup_accepts=3)
    del table["draft"]
    assert order("auto", table) == [("lookup", 3)]
    assert order("off", table) == []
