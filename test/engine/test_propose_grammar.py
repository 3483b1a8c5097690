"""One step's draft under a grammar (engine/propose.py): the forced text first, then a drafter's
continuation cut before the first refused token; the suffix drafter's continuation is also cut by
its policy, with the forced rows counted, and its whole draft is settled in hindsight, while the
lookup drafter's constrained drafts keep the per-step length of its policy. Real drafters, the
embedded model's vocabulary and a real grammar; no target pass (the verify loop is the engine's,
tested on real GGUF files)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from gemma_spec_ros.engine.config import LookupConfig, ModelConfig, SpecConfig, SuffixConfig
from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
from gemma_spec_ros.engine.drafters.suffix import SuffixDrafter
from gemma_spec_ros.engine.grammar.matcher import GrammarVocab, compiled_constraint
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.policy.costs import CostModel
from gemma_spec_ros.engine.policy.hindsight import DraftHindsight
from gemma_spec_ros.engine.policy.length import DraftLengthPolicy
from gemma_spec_ros.engine.propose import DraftRequest, Drafting, propose

GRAMMAR = 'root ::= "{\\"place\\": \\"" ("sink" | "stove" | "fridge") "\\", \\"pose\\": \\"" ("left" | "right") "\\"}"'
#: earlier answers: the same place, two poses (the draft goes as far as they agree)
ANSWERS = ['{"place": "sink", "pose": "left"}', '{"place": "sink", "pose": "right"}']


@pytest.fixture(scope="module")
def model(embedded_model_path: Path) -> Iterator[LlamaModel]:
    target = LlamaModel(ModelConfig(str(embedded_model_path), n_ctx=256))
    yield target
    target.close()


def step(model: LlamaModel, drafters: Dict[str, Drafting], mode: str, context: List[int]):
    """One step's proposal at the start of a constrained answer, and the request's hindsight."""
    costs = next(iter(drafters.values())).policy.costs
    grammar = GrammarVocab.of(model).start(compiled_constraint(grammar=GRAMMAR))
    hindsight = DraftHindsight({name: d.policy for name, d in drafters.items()})
    try:
        proposal = propose(drafters, costs, DraftRequest(mode, SpecConfig(mode=mode, draft_max=12), context,
                                                         12, 12, grammar, cut=True))
    finally:
        grammar.close()
    for whole in proposal.wholes:  # as Steps.plan_step hands them on
        hindsight.add(whole, proposal.n_forced)
    return proposal, hindsight


def learned(model: LlamaModel, make) -> Dict[str, Drafting]:
    """A drafter that saw both answers (its history), with a policy on a measured device where a
    row costs little (so that a draft not yet judged is worth verifying)."""
    costs = CostModel()
    for rows in range(1, 34):
        costs.observe_verify(rows, (16.0 + 0.5 * (rows - 1)) / 1e3)
    drafter = make()
    prompt = model.tokenize("Where? Answer:")
    for answer in ANSWERS:
        drafter.begin(prompt)
        drafter.end(prompt + model.tokenize(answer, add_special=False))
    return {drafter.name: Drafting(drafter, DraftLengthPolicy(drafter.name, costs))}


def test_the_suffix_drafters_constrained_draft_follows_the_forced_text_and_is_settled_in_hindsight(model) -> None:
    drafters = learned(model, lambda: SuffixDrafter(SuffixConfig(match_factor=0)))
    context = model.tokenize("Where? Answer:")
    drafters["suffix"].drafter.begin(context)
    proposal, hindsight = step(model, drafters, "suffix", context)
    forced = proposal.draft.tokens[:proposal.n_forced]
    text = b"".join(model.token_bytes(t) for t in forced).decode()
    assert proposal.n_forced > 0 and '{"place": "'.startswith(text), text
    # the history goes on after the forced text as far as its answers agree; the whole draft is
    # kept to be settled against the tokens the request will emit
    assert proposal.draft.source == "suffix" and len(proposal.draft) > proposal.n_forced
    assert hindsight.pending
    drafted = b"".join(model.token_bytes(t) for t in proposal.draft.tokens).decode()
    assert drafted.startswith('{"place": "sink') and '{"place": "sink", "pose": "'.startswith(drafted), drafted


def test_the_lookup_drafters_constrained_draft_is_not_cut_by_its_evidence(model) -> None:
    drafters = learned(model, lambda: LookupDrafter(LookupConfig()))
    context = model.tokenize("Where? Answer:")
    drafters["lookup"].drafter.begin(context)
    proposal, hindsight = step(model, drafters, "lookup", context)
    assert proposal.n_forced > 0 and not hindsight.pending
