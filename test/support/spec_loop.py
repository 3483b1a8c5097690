"""A minimal draft-verify loop: one drafter, a real target (LlamaModel), the engine's own sampler
and verification functions, for a drafter the engine's mode table does not name yet (EAGLE-3).

It runs what the engine's loop runs, without its policy, grammar, text or stats: the prompt's
pass, then per step ``propose`` -> one target decode of [pending] + draft -> ``verify_exact`` (or
``verify_rejection`` for a sampled request) -> rollback of the rejected positions. A seeded request
draws the same random numbers whatever the drafter proposes, so its tokens are plain decoding's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.sampling import Sampler, draft_stream, make_rng, verify_exact, verify_rejection
from gemma_spec_ros.engine.drafters.base import Draft
from gemma_spec_ros.engine.config import SamplingParams, SpecConfig



@dataclass
class LoopResult:
    """The tokens a request emitted (end-of-generation excluded) and what its passes did."""

    tokens: List[int]
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    drafts: List[Draft] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)  # accepted drafts by position

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def generate(target: LlamaModel, drafter, prompt: Sequence[int], max_tokens: int,
             k: int = 3, spec: SpecConfig = SpecConfig(p_min=0.0, adaptive=False),
             sampling: SamplingParams = SamplingParams(), rejection: bool = False,
             reuse_prompt: bool = True) -> LoopResult:
    """``max_tokens`` tokens after ``prompt`` (fewer at end-of-generation), drafting up to ``k``
    tokens a step with ``drafter`` (None: plain decoding)."""
    sampler, rng = Sampler(sampling), make_rng(sampling.seed)
    use_rejection = rejection and not sampler.greedy
    reused = target.reuse_prefix(list(prompt), keep_last=1) if reuse_prompt else 0
    if not reuse_prompt:
        target.clear()
    rest = list(prompt[reused:])
    first = verify_exact(target.decode(rest, [len(rest) - 1]), (), sampler, rng).tokens[0]
    if drafter is not None:
        drafter.begin(list(prompt), sampling if use_rejection else None,
                      draft_stream(rng) if use_rejection else None)
    result = LoopResult([])
    context, pending = list(prompt), first
    while True:
        if target.is_eog(pending):
            break
        result.tokens.append(pending)
        if len(result.tokens) >= max_tokens:
            break
        context.append(pending)
        room = min(k, max_tokens - len(result.tokens) - 1)
        draft = drafter.propose(context, room, spec) if drafter is not None and room > 0 else Draft()
        n_keep = target.n_past
        rows = target.decode([pending, *draft.tokens], range(len(draft) + 1))
        if use_rejection:
            verdict = verify_rejection(rows, draft.tokens, draft.probs, sampler, rng)
        else:
            verdict = verify_exact(rows, draft.tokens, sampler, rng)
        target.rollback(n_keep + 1 + verdict.num_accepted)
        _count(result, draft, verdict.num_accepted)
        context.extend(verdict.tokens[:-1])
        for token in verdict.tokens[:-1]:
            if target.is_eog(token) or len(result.tokens) >= max_tokens:
                return result
            result.tokens.append(token)
        pending = verdict.tokens[-1]
    return result


def _count(result: LoopResult, draft: Draft, accepted: int) -> None:
    result.passes += 1
    if not draft.tokens:
        return
    result.drafts.append(draft)
    result.drafted += len(draft)
    result.accepted += accepted
    while len(result.accepted_at) < len(draft):
        result.accepted_at.append(0)
    for i in range(accepted):
        result.accepted_at[i] += 1
