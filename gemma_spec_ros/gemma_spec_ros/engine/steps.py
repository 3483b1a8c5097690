"""A request's life in steps: its start, its prompt pass, each step's two halves, its end.

One step is one target pass: **plan** (the draft and the rows of the pass: the pending token and the
draft; under a grammar each row's mask) -> the pass decodes the rows -> **settle** (verify the rows'
logits, roll the rejected tokens' KV cells back, feed the stats and the drafter's policy). The
engine runs one request at a time, each step in a pass of its own (engine.py,
:meth:`Steps.step_alone`); the scheduler runs several requests' halves around one shared pass
(slots.py). Both drive the same halves, so a request's tokens, stats and learning are the same
either way.

    steps = Steps(target, costs, conversations, spec=lambda: engine.spec, closing=event, faults=[])
    state = steps.start_request(request, counted, cancel, kv, drafters)  # sampler, text, grammar
    first = steps.prompt_pass(state, cancel)    # or prompt_rest -> a pass -> prompt_done
    planned, tokens = steps.step_alone(state)   # or plan_step -> a shared pass -> settle_step
    steps.end_request(state)                    # drafters learn, stats roll up
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .config import SpecConfig
from .conversations import ConversationCache
from .grammar.matcher import GrammarVocab
from .modes import MODES
from .policy.costs import CostModel
from .policy.hindsight import DraftHindsight
from .policy.length import SOLO, PassShare
from .propose import GRAMMAR_DRAFT_MAX, GRAMMAR_K, Drafting, DraftRequest, Proposal, propose
from .request import CountedPrompt, GenerationRequest
from .request_state import Ends, RequestState
from .sampling import Sampler, draft_stream, make_rng, verify_exact, verify_rejection
from .stats import SpecStats, timed

#: The largest verify pass: pending token + a draft of SpecConfig.draft_max <= 64 tokens.
MAX_VERIFY_ROWS = 65


@dataclass(frozen=True)
class PlannedStep:
    """A step between its two halves (:meth:`Steps.plan_step`, :meth:`Steps.settle_step`): the
    proposal, the rows the target pass decodes (pending token + draft), the sequence's length before
    them, when the step began, the speculation settings it was planned with (read once per step:
    the step's stats and label say the mode it used), and the grammar's masks of the rows (None
    without a grammar; see Grammar.row_masks), which say the rows whose logits verification needs
    (all, unless a grammar allows some draft tokens alone: their rows need none)."""

    proposal: Proposal
    batch: List[int]
    n_keep: int
    started: float
    spec: SpecConfig
    masks: Optional[List[Optional[np.ndarray]]] = None

    @functools.cached_property
    def logit_rows(self) -> Sequence[int]:
        """The rows the pass computes logits for: those with a mask, or all without a grammar
        (found once per step; the pass, the stats and the spread of its logits read it)."""
        masks = self.masks
        if masks is None or all(mask is not None for mask in masks):
            return range(len(self.batch))
        return [row for row, mask in enumerate(masks) if mask is not None]

    @property
    def every_row(self) -> bool:
        """Whether every row asks for logits (a pass the cost model's sizes describe)."""
        return len(self.logit_rows) == len(self.batch)

    def spread(self, rows: Sequence[np.ndarray]) -> Sequence[Optional[np.ndarray]]:
        """The pass's logits, one entry per row of the batch: None where none was asked."""
        if self.every_row:
            return rows
        spread: List[Optional[np.ndarray]] = [None] * len(self.batch)
        for at, row in zip(self.logit_rows, rows):
            spread[at] = row
        return spread


class Steps:
    """The halves of a request's life over one target (module docstring).

    ``spec`` gives the speculation settings in effect (read once per step); ``closing`` is the
    engine's closing flag (a running request stops at its next step); ``faults`` is where problems
    outside any request go (a drafter's failed save), for the engine's owner to take.
    """

    def __init__(self, target: Any, costs: CostModel, conversations: ConversationCache,
                 spec: Callable[[], SpecConfig], closing: threading.Event, faults: List[str]) -> None:
        self.target = target
        self.costs = costs
        self.conversations = conversations
        self._spec = spec
        self._closing = closing
        self._faults = faults
        #: llguidance's tokenizer of the vocabulary: made at load (config.prepare_grammar) or by
        #: the first constrained request
        self.grammar_vocab: Optional[GrammarVocab] = None
        self._stats_lock = threading.Lock()
        self._rolling = SpecStats()

    @property
    def spec(self) -> SpecConfig:
        """The speculation settings in effect now (the engine's; a step reads them once)."""
        return self._spec()

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    @property
    def closing(self) -> bool:
        """The engine is closing: running requests stop at their next step."""
        return self._closing.is_set()

    def stop_requested(self, cancel: Any) -> bool:
        """The engine is closing, or ``cancel`` (anything with ``is_set``) is set."""
        return self.closing or (cancel is not None and cancel.is_set())

    def report(self, fault: str) -> None:
        """A problem outside any request's result (a drafter's failed save, a scheduler fault),
        for the engine's owner (Engine.take_faults)."""
        self._faults.append(fault)

    def rolling_stats(self) -> SpecStats:
        """SpecStats over every request that ended (a copy)."""
        with self._stats_lock:
            snap = self._rolling.snapshot()
        snap.plain_token_time = self.costs.plain_token_time
        return snap

    # -- a request's start and its prompt ------------------------------------------------------
    def start_request(self, request: GenerationRequest, counted: CountedPrompt, cancel: Any,
                      kv: Any, drafters: Dict[str, Drafting]) -> RequestState:
        """A request's state, from its checked prompt (``counted``: its tokens, chat turn and
        compiled constraint): its sampler and seed stream, its text (a chat turn's: the message's,
        read by the turn's reply stream), its stats, its grammar; the KV sequence it decodes in
        (the target, or one sequence of it) and its drafters.

        The grammar starts here, in the generation thread (the models are freed only under its
        lock): the first constrained request builds llguidance's tokenizer of the vocabulary
        (~2-4 s for 262,144 tokens, once per engine) unless it was built at load."""
        prompt = list(counted.tokens)
        sampler = Sampler(request.sampling)
        verification = self.spec.verification
        ends = Ends(is_eog=self.target.is_eog, context_full=lambda: kv.n_past + 1 >= self.n_ctx,
                    stop_requested=lambda: self.stop_requested(cancel))
        text = counted.prepared.text_stream(self.target, request.stop)
        state = RequestState(request, sampler, make_rng(request.sampling.seed),
                             SpecStats(num_prompt_tokens=len(prompt)), text,
                             prompt, ends, DraftHindsight({n: d.policy for n, d in drafters.items()}),
                             verification, verification == "rejection" and not sampler.greedy,
                             kv=kv, drafters=drafters, prepared=counted.prepared)
        state.stats.plain_token_time = self.costs.plain_token_time
        if counted.constraint is not None:  # after state.started: its time counts
            if self.grammar_vocab is None:
                self.grammar_vocab = GrammarVocab.of(self.target)
            state.grammar = self.grammar_vocab.start(counted.constraint)
        return state

    def prompt_pass(self, state: RequestState, cancel: Any = None) -> int:
        """Decode the prompt in a pass of its own, sample the first token, start the drafters and
        their policies; the token.

        Raises DecodeInterrupted if ``cancel``, the engine's closing or the request's time budget
        stops it between two n_batch chunks."""
        with timed(state.stats, "prompt_time"):
            rest = self.prompt_rest(state)
            rows = state.kv.decode(
                rest, [len(rest) - 1], stop=lambda: self.stop_requested(cancel) or state.over_budget())
        return self.prompt_done(state, rows)

    def prompt_rest(self, state: RequestState) -> List[int]:
        """The prompt tokens left to decode once the KV cells the request's sequence already holds
        are kept (:meth:`_keep_prompt_prefix`); the drafters learn that a target pass follows."""
        self._before_target_pass(state, state.mode(self.spec))
        reused = self._keep_prompt_prefix(state)
        state.stats.num_prompt_tokens_reused = reused
        return state.prompt[reused:]

    def prompt_done(self, state: RequestState, rows: Sequence[np.ndarray]) -> int:
        """The prompt is decoded (``rows``: its last row's logits): sample the first token (under
        the grammar, which moves on by it), start the drafters and their policies; the token."""
        masks = None if state.grammar is None else [state.grammar.allowed().bits.copy()]  # the first token's
        first = verify_exact(rows, (), state.sampler, state.rng, masks).tokens[0]
        if state.grammar is not None:
            state.grammar.accept(first)
        state.stats.time_to_first_token = time.perf_counter() - state.started
        # Drafts sampled for rejection verification draw from their own stream of the request's seed.
        sampling = state.request.sampling if state.use_rejection else None
        draft_rng = draft_stream(state.rng) if state.use_rejection else None
        for drafting in state.drafters.values():
            drafting.drafter.begin(state.prompt, sampling, draft_rng)
            drafting.policy.new_request()
        state.context, state.pending = list(state.prompt), first
        if state.request.reuse_prompt:  # a chat turn keeps its prompt's KV for the next turn
            state.prepared.after_prompt_pass(state.kv, self.conversations)
        return first

    def _keep_prompt_prefix(self, state: RequestState) -> int:
        """Prompt tokens whose KV cells the previous request left in the request's sequence (its
        common prefix with the prompt, less the last token, whose logits are needed); the rest is
        rolled back. The prompt may first bring cells of its own back (a chat turn: its
        conversation's KV, if another request ran since its last turn and a kept snapshot shares
        more: :class:`~.conversations.ConversationCache`).

        With prompt reuse off the cache is emptied and the whole prompt evaluated in one batch: the
        same shapes whatever ran before (quantized logits depend slightly on batch shapes, so with
        reuse a seeded request's text can depend on the previous request; F16/F32 cannot differ).
        """
        kv = state.kv
        if not state.request.reuse_prompt:
            kv.clear()
            return 0
        state.prepared.before_prompt_pass(kv, self.conversations)
        return kv.reuse_prefix(state.prompt, keep_last=1)

    @staticmethod
    def _before_target_pass(state: RequestState, mode: str) -> None:
        """Each drafter learns whether the pass about to run belongs to a step of its mode (an
        assistant's target then exports the hidden rows it reads; see Drafter.before_target_pass)."""
        chain = MODES[mode].chain
        for name, drafting in state.drafters.items():
            drafting.drafter.before_target_pass(name in chain)

    # -- a step -------------------------------------------------------------------------------
    def step_alone(self, state: RequestState) -> Tuple[PlannedStep, Tuple[int, ...]]:
        """One step in a target pass of its own: plan -> decode pending + draft -> settle. Returns
        the planned step and the tokens the pass emits (the accepted draft prefix + the recovered
        or bonus token)."""
        planned = self.plan_step(state)
        with timed(state.stats, "verify_time"):
            rows, seconds = state.kv.timed_decode(planned.batch, planned.logit_rows)
        if planned.every_row:
            self.costs.observe_verify(len(planned.batch), seconds)
        return planned, self.settle_step(state, planned, planned.spread(rows))

    def plan_step(self, state: RequestState, share: PassShare = SOLO,
                  spec: Optional[SpecConfig] = None) -> PlannedStep:
        """The first half of a step: the draft to verify and the rows of the target pass
        (``share``: what else the pass holds when several requests run at once). Under a grammar,
        each row's mask is computed here, once, for verification to sample under, and a row whose
        next draft token the grammar allows alone asks for no logits nor a mask (most of a JSON
        plan's keys, punctuation and enum values; on this CPU a row without its logits costs
        about 0.4 of one with them). ``spec``: the settings of this step (default: the engine's now)."""
        started = time.perf_counter()
        stats, spec = state.stats, spec or self.spec
        mode = state.mode(spec)
        room = self.n_ctx - state.kv.n_past - 1
        hard_cap = max(0, min(state.request.max_tokens - len(state.generated) - 1, room))
        # constrained text is more predictable: its drafts may run longer than K (propose.py)
        k_cap = min(spec.draft_max if state.grammar is None else max(spec.draft_max, GRAMMAR_K), hard_cap)
        state.context.append(state.pending)
        self._before_target_pass(state, mode)  # for this step's verify pass
        with timed(stats, "draft_time"):
            if state.hindsight.pending:
                state.hindsight.settle(state.generated)
            proposal = propose(state.drafters, self.costs, DraftRequest(
                mode, spec, state.context, k_cap, min(GRAMMAR_DRAFT_MAX, hard_cap), state.grammar,
                state.hindsight is not None, share))
            for whole in proposal.wholes:  # drafts a policy cut: their guesses are settled later
                state.hindsight.add(whole, len(state.generated) + proposal.n_forced)
            planned = PlannedStep(proposal, [state.pending, *proposal.draft.tokens], state.kv.n_past,
                                  started, spec, proposal.masks)
            stats.num_grammar_cut_tokens += proposal.n_cut
            stats.num_grammar_sole_rows += len(planned.batch) - len(planned.logit_rows)
        return planned

    def settle_step(self, state: RequestState, planned: PlannedStep,
                    rows: Sequence[Optional[np.ndarray]]) -> Tuple[int, ...]:
        """The second half of a step, given the pass's logits rows: accept -> roll back the rejected
        tokens' KV cells -> feed the request's stats and the drafter's policy (which learns from its
        own part of the draft, after the tokens a grammar forced). Returns the tokens the pass emits."""
        stats, proposal = state.stats, planned.proposal
        draft, n_forced = proposal.draft, proposal.n_forced
        with timed(stats, "sample_time"):
            if state.use_rejection:
                verdict = verify_rejection(rows, draft.tokens, draft.probs, state.sampler, state.rng,
                                           planned.masks)
            else:
                verdict = verify_exact(rows, draft.tokens, state.sampler, state.rng, planned.masks)
            if state.grammar is not None:
                state.grammar.advance(verdict.tokens)
        state.kv.rollback(planned.n_keep + 1 + verdict.num_accepted)
        stats.num_steps += 1
        stats.num_step_tokens += len(verdict.tokens)
        if draft.tokens:
            # also the histogram, the tokens by source and the grammar's forced tokens (n_forced)
            stats.observe_draft(len(draft), verdict.num_accepted, draft.source, n_forced)
            own = len(draft) - n_forced
            if own > 0 and verdict.num_accepted >= n_forced:  # the drafter's part was reached
                state.drafters[draft.source].policy.observe(own, verdict.num_accepted - n_forced)
        state.context.extend(verdict.tokens[:-1])
        state.pending = verdict.tokens[-1]
        stats.predicted_speedup = proposal.decision.predicted_speedup
        stats.plain_token_time = self.costs.plain_token_time
        stats.generation_time += time.perf_counter() - planned.started
        return verdict.tokens

    # -- the end --------------------------------------------------------------------------------
    def end_request(self, state: RequestState) -> None:
        """The request ended (finished, cancelled, or failed): drafters learn, stats roll up."""
        state.stats.plain_token_time = self.costs.plain_token_time
        if state.grammar is not None:
            state.grammar.close()
        with self._stats_lock:  # first: whatever follows, the request counts
            self._rolling.merge(state.stats)
        for drafting in state.drafters.values():
            drafter = drafting.drafter
            drafter.end(state.prompt + state.generated)  # learns; a failed save is kept, never raised
            fault = drafter.take_fault()
            if fault:
                self.report(fault)


__all__ = ["MAX_VERIFY_ROWS", "PlannedStep", "Steps"]
