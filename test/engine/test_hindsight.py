"""Cut drafts (policy.py "Cutting each draft", engine/policy/hindsight.py): n-gram lookup drafts long at every
step, each whole draft is checked token by token against the emitted text and teaches the policy per
evidence class, and the policy cuts each draft where its expected gain peaks. The mechanism on the
real LookupDrafter and policy (no model), then output parity on the F16 copy under the exact build."""
from __future__ import annotations

from pathlib import Path

import pytest

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
from gemma_spec_ros.engine.policy.acceptance import PooledEvidenceAcceptance
from gemma_spec_ros.engine.policy.costs import CostModel
from gemma_spec_ros.engine.policy.length import DraftLengthPolicy
from gemma_spec_ros.engine.policy.hindsight import DraftHindsight
from gemma_spec_ros.engine.drafters.base import Draft
from gemma_spec_ros.engine.config import EngineConfig, LookupConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest

#: this 2-core CPU's pass costs by rows (ms; llama.cpp's step profile of the embedded model, fast
#: build): a 9-row pass costs 2.2 one-row passes
PASS_MS = {1: 20.0, 2: 25.0, 3: 27.6, 4: 27.6, 5: 33.0, 6: 35.0, 7: 38.0, 8: 41.0, 9: 43.6}
STRONG = ("context", True, True, False)  # a unanimous 3-or-4-gram of the request, seen once
AGAIN = ("context", True, True, True)  # the same, seen at least twice
WEAK = ("context", False, False, False)  # a 1- or 2-gram's majority


def policy() -> DraftLengthPolicy:
    costs = CostModel()
    for rows, ms in PASS_MS.items():
        costs.observe_verify(rows, ms / 1e3)
    return DraftLengthPolicy("lookup", costs)


def test_the_cut_verifies_strong_evidence_whole_and_cuts_weak_evidence() -> None:
    """Strong matches right at every position, weak ones wrong from the first: a draft of 8 strong
    tokens is verified whole, one whose strong start turns weak is cut before the weak part, and an
    all-weak one is not verified at all."""
    p = policy()
    for _ in range(30):
        p.evidence.observe((STRONG,) * 8, 8)
        p.evidence.observe((WEAK,) * 4, 0)
    whole = p.cut((STRONG,) * 8)
    assert whole.draft_len == 8 and whole.predicted_speedup > 3.0
    assert p.cut((STRONG,) * 3 + (WEAK,) * 5).draft_len == 3
    assert p.cut((WEAK,) * 8).draft_len == 0
    # nothing measured yet: trust the drafter, verify the whole draft
    assert DraftLengthPolicy("lookup", CostModel()).cut((WEAK,) * 5).draft_len == 5


def test_a_match_seen_again_is_its_own_class() -> None:
    """The drafter tells a unanimous long match seen once from one seen again (engine/drafters/lookup.py,
    Evidence); where the first keep failing and the second holding, the cut keeps the draft up to its
    first match seen only once."""
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5]
    drafter = LookupDrafter(LookupConfig())
    drafter.begin(context)
    draft = drafter.propose(context, 3)
    # "2 3 4 5" went on with 9 twice and 7 once: 9, then "3 4 5 9 -> 1" seen twice, then
    # "4 5 9 1 -> 2" twice
    assert draft.tokens == (9, 1, 2)
    assert draft.evidence == (("context", True, False, True),) + (AGAIN,) * 2
    p = policy()
    for _ in range(30):
        p.evidence.observe((AGAIN,) * 8, 8)
        p.evidence.observe((STRONG,) * 4, 0)
    assert p.cut((AGAIN,) * 3 + (STRONG,) * 5).draft_len == 3


def test_an_unknown_class_starts_at_the_prior_and_learns_per_position() -> None:
    p = policy()
    assert p.evidence.rate(STRONG, 0) == 0.5
    p.evidence.observe((STRONG, STRONG, STRONG), 1)  # position 0 right, 1 wrong, 2 not reached
    assert p.evidence.rate(STRONG, 0) == pytest.approx(2 / 3)  # (1 + 2 * 0.5) / (1 + 2)
    assert p.evidence.rate(STRONG, 1) == pytest.approx(1 / 3)  # (0 + 2 * 0.5) / (1 + 2)
    assert p.evidence.rate(STRONG, 2) == 0.5 and p.evidence.rate(STRONG, 7) == 0.5  # 2+ share one


def test_the_suffix_drafters_sparse_classes_lean_on_its_pooled_rate_not_on_a_coin() -> None:
    """The suffix drafter's policy pools (policy/acceptance.py, PooledEvidenceAcceptance): a class
    never seen starts at the drafter's rate over all its tokens, a position never reached at its
    class's rate over all positions; lookup's keeps the fixed prior."""
    seen, unseen = ("history", True, True, True), ("history", True, False, False)
    suffix_policy, lookup_policy = DraftLengthPolicy("suffix", CostModel()), policy()
    for model in (suffix_policy.evidence, lookup_policy.evidence):
        for _ in range(40):
            model.observe((seen,) * 2, 2)  # positions 0 and 1 right; position 2 never reached
    pooled = suffix_policy.evidence
    assert isinstance(pooled, PooledEvidenceAcceptance)
    assert pooled.rate(unseen, 0) > 0.9 and lookup_policy.evidence.rate(unseen, 0) == 0.5
    assert pooled.rate(seen, 2) > 0.9 and lookup_policy.evidence.rate(seen, 2) == 0.5
    pooled.observe((unseen,) * 3, 0)  # its first token wrong: that class, at that position, drops most
    assert pooled.rate(unseen, 0) < pooled.rate(unseen, 1) < pooled.rate(seen, 0)


def test_after_forced_text_a_draft_must_beat_the_forced_text_alone() -> None:
    """Under a grammar the pass also carries the forced tokens (taken as accepted): a drafted token
    then must add more than its row costs to a pass that already emits them, a stiffer test than
    beating plain decoding. Rows cost 10 ms + 2.5 ms each; a token right 60 % of the time."""
    costs = CostModel()
    for rows in range(1, 20):
        costs.observe_verify(rows, (10.0 + 2.5 * (rows - 1)) / 1e3)
    p = DraftLengthPolicy("suffix", costs)
    for right in [True, False, True, False, True] * 40:
        p.evidence.observe((WEAK,), int(right))
    assert p.evidence.rate(WEAK, 0) == pytest.approx(0.6, abs=0.05)
    alone, after_forced = p.cut((WEAK,)), p.cut((WEAK,), forced=8)
    assert alone.draft_len == 1 and alone.predicted_speedup > 1.2  # 1.6 tokens in 12.5 ms
    assert after_forced.draft_len == 0  # 9 tokens in 30 ms: more than 9.6 in 32.5 ms
    assert after_forced.predicted_speedup == pytest.approx(9 * 10.0 / 30.0, rel=0.02)


def test_a_whole_draft_teaches_as_the_text_comes_the_tokens_past_the_cut_included() -> None:
    p = policy()
    uncut, drafter = DraftHindsight({"lookup": p}), LookupDrafter(LookupConfig())
    context = [1, 2, 3, 7, 8, 9, 1, 2, 3]
    drafter.begin(context)
    whole = drafter.propose(context, 3)
    assert whole.tokens == (7, 8, 9) and whole.evidence == (STRONG,) * 3
    uncut.add(whole, 5)  # it guesses emitted[5:8]
    emitted = [0, 0, 0, 0, 0, 7]
    uncut.settle(emitted)  # 7 is known right, the rest not yet
    assert p.evidence.tried == {(STRONG, 0): 1.0} and uncut.pending
    uncut.settle(emitted + [8, 4])  # 8 right, then 4 where it guessed 9: done
    assert p.evidence.tried == {(STRONG, 0): 1.0, (STRONG, 1): 1.0, (STRONG, 2): 1.0}
    assert p.evidence.accepted == {(STRONG, 0): 1.0, (STRONG, 1): 1.0, (STRONG, 2): 0.0}
    assert not uncut.pending
    uncut.add(Draft((5,), None, "lookup"), 9)  # a draft without evidence is not kept
    assert not uncut.pending


def test_a_policy_that_cut_everything_drafts_again_when_the_text_repeats() -> None:
    """Text that stopped repeating cut every draft to nothing; once it repeats again the whole
    drafts, checked against it, bring long drafts back within a few steps (no probe needed)."""
    p = policy()
    uncut, drafter = DraftHindsight({"lookup": p}), LookupDrafter(LookupConfig())
    for _ in range(40):
        p.evidence.observe((STRONG,) * 4, 0)  # strong matches kept failing
    pattern = list(range(100, 112))
    prompt = pattern * 2
    drafter.begin(prompt)
    context, emitted, lengths = list(prompt), [], []
    for _ in range(40):
        uncut.settle(emitted)
        whole = drafter.propose(context, 8)
        uncut.add(whole, len(emitted))
        lengths.append(p.cut(whole.evidence).draft_len if whole.tokens else 0)
        token = pattern[len(emitted) % len(pattern)]  # plain steps: the text goes on repeating
        context.append(token)
        emitted.append(token)
    assert lengths[0] == 0, lengths
    assert lengths[-1] == 8, lengths


REPEATING = ("Copy this line four times, exactly: the red robot picks up the blue cup and puts it on "
             "the green table.\nthe red robot picks up the blue cup and puts it on the green table.\n")


@pytest.mark.exact
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_cut_drafts_keep_output_identical_to_off(exact_build: None, f16_model_path: Path,
                                                 sampling: SamplingParams) -> None:
    """Adaptive lookup at K 8 drafts 8 tokens at every step and the policy cuts each draft (where,
    depends on the pass costs measured on this host at the time, so not asserted here: the pure
    tests above pin the cut down); the output is still plain decoding's."""
    config = EngineConfig(target=ModelConfig(str(f16_model_path), n_ctx=1024),
                          spec=SpecConfig(mode="lookup", draft_max=8, adaptive=True))
    with Engine(config) as engine:
        request = GenerationRequest(REPEATING, max_tokens=96, sampling=sampling, spec_mode="off")
        plain = [t for step in engine.generate(request) for t in step.tokens]
        steps = list(engine.generate(GenerationRequest(REPEATING, max_tokens=96, sampling=sampling,
                                                       spec_mode="lookup")))
    tokens = [t for step in steps for t in step.tokens]
    assert tokens == plain
    stats = steps[-1].stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, "nothing verified: vacuous"
