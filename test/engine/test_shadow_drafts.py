"""Shadow drafts (engine/shadow.py): while the lookup policy is off, plain steps still draft for
free and check the draft against the tokens emitted, so the policy comes back on when the text
turns predictable, without a probe. The mechanism on the real LookupDrafter and policy (no model),
then output parity on the F16 copy under the exact build."""
from __future__ import annotations

from pathlib import Path
import pytest

from gemma_spec_ros.engine.drafting import Drafting
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.lookup import LookupDrafter
from gemma_spec_ros.engine.policy import CostModel, DraftLengthPolicy
from gemma_spec_ros.engine.shadow import ShadowDrafts
from gemma_spec_ros.engine.types import (EngineConfig, GenerationRequest, LookupConfig, ModelConfig,
                                         SamplingParams, SpecConfig)

#: a 2-core CPU's pass costs by rows (ms, the embedded model, measured at load): a 1-token draft
#: costs 1.6 passes, so drafting pays only where most drafts are accepted
PASS_MS = {1: 19.0, 2: 30.1, 3: 43.9, 4: 36.5, 5: 53.2}


def off_policy() -> DraftLengthPolicy:
    """A lookup policy whose first draft was rejected (as on the replay's prompts that stayed at
    plain speed), so that it decided drafting does not pay, and whose probes never come."""
    costs = CostModel()
    for rows, ms in PASS_MS.items():
        costs.observe_verify(rows, ms / 1e3)
    policy = DraftLengthPolicy("lookup", costs, probe_min=10**6, probe_max=10**6, probe_new_requests=False)
    policy.observe(3, 0)
    assert policy.decide(4, True).draft_len == 0 and not policy.enabled
    return policy


def test_shadow_drafts_turn_the_policy_back_on_for_predictable_text() -> None:
    pattern = list(range(100, 112))
    prompt = pattern * 2
    drafter, policy, shadows = LookupDrafter(LookupConfig()), off_policy(), ShadowDrafts()
    drafter.begin(prompt)
    context, emitted = list(prompt), []
    steps = 0
    while not policy.enabled:
        steps += 1
        assert steps <= 12, "shadow drafts did not bring the policy back on"
        assert policy.decide(4, True).draft_len == 0  # off: a plain step, no probe
        shadows.settle(emitted, {"lookup": policy})
        shadows.draft([(drafter, policy)], "", context, len(emitted), 4)
        token = pattern[len(emitted) % len(pattern)]  # the text goes on repeating itself
        context.append(token)
        emitted.append(token)
        policy.decide(4, True)
    assert policy.decide(4, True).draft_len >= 2  # and it drafts long: the shadows were all right


def test_a_shadow_draft_is_settled_at_its_first_wrong_token() -> None:
    policy, shadows, drafter = off_policy(), ShadowDrafts(), LookupDrafter(LookupConfig())
    context = [1, 2, 3, 7, 8, 9, 1, 2, 3]
    drafter.begin(context)
    assert drafter.propose(context, 3).tokens == (7, 8, 9)
    shadows.draft([(drafter, policy)], "", context, n_emitted=5, k_cap=3)
    emitted = [0, 0, 0, 0, 0, 7]
    shadows.settle(emitted, {"lookup": policy})
    assert policy.acceptance.tried[0] == 1.0  # only the rejected draft: 7 matched, 8 not known yet
    shadows.settle(emitted + [5], {"lookup": policy})
    tried, accepted = policy.acceptance.tried, policy.acceptance.accepted
    assert (round(tried[0], 4), round(tried[1], 4), accepted[0], accepted[1]) == (1.98, 1.0, 1.0, 0.0)
    # the drafter whose draft the step verifies makes no shadow draft, nor one whose policy is on
    shadows.draft([(drafter, policy)], "lookup", context, n_emitted=7, k_cap=3)
    policy.enabled = True
    shadows.draft([(drafter, policy)], "", context, n_emitted=7, k_cap=3)
    shadows.settle(emitted + [5, 1, 2, 3], {"lookup": policy})
    assert round(policy.acceptance.tried[0], 4) == 1.98  # nothing more was observed


REPEATING = ("Copy this line four times, exactly: the red robot picks up the blue cup and puts it on "
             "the green table.\nthe red robot picks up the blue cup and puts it on the green table.\n")


@pytest.mark.exact
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_shadow_drafting_keeps_output_identical_to_off(exact_build: None, f16_model_path: Path,
                                                       sampling: SamplingParams) -> None:
    """The lookup policy starts off with its probes disabled: every draft verified here exists
    because shadow drafts turned it back on; the output must still be plain decoding's."""
    config = EngineConfig(target=ModelConfig(str(f16_model_path), n_ctx=1024),
                          spec=SpecConfig(mode="lookup", draft_max=4))
    with Engine(config) as engine:
        request = GenerationRequest(REPEATING, max_tokens=96, sampling=sampling, spec_mode="off")
        plain = [t for step in engine.generate(request) for t in step.tokens]
        lookup = engine.drafters["lookup"]
        engine.drafters["lookup"] = Drafting(lookup.drafter, off_policy())
        steps = list(engine.generate(GenerationRequest(REPEATING, max_tokens=96, sampling=sampling,
                                                       spec_mode="lookup")))
    tokens = [t for step in steps for t in step.tokens]
    assert tokens == plain
    assert steps[-1].stats.num_accepted_tokens > 0, "no shadow draft turned the policy on: vacuous"
