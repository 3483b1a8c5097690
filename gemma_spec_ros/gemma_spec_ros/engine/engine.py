"""The engine: target model + drafters + policy, serving its requests one at a time or, with
``max_running`` > 1, several at once (slots.py).

Public API (the node and the bench use only this):

    engine = Engine(config)                  # loads models; raises ModelLoadError, VocabMismatchError,
                                             # CacheFormatError (all EngineError) or ValueError
    engine.spec                              # current SpecConfig (frozen)
    engine.check_spec(spec) -> str           # '' if usable, else the reason (e.g. no draft model)
    engine.update_spec(spec)                 # thread-safe; raises ValueError(reason); next step uses it
    engine.count_prompt_tokens(request)      # tokens of the (templated) prompt; thread-safe, ~ms
    engine.count_prompt(request)             # the same as a CountedPrompt, with the tokens, the
                                             # constraint compiled (ValueError if it does not) and
                                             # a chat turn prepared (template, constraint, syntax)
    engine.check_request(request[, n_prompt_tokens])  # raises PromptTooLongError if prompt +
                                             # max_tokens > n_ctx, ValueError if its spec_mode cannot
                                             # be used here or its grammar / json_schema does not
                                             # compile (pass the count if you have it)
    engine.n_ctx                             # target context length (tokens)
    for step in engine.generate(request, cancel=threading.Event()[, prompt=counted]):
        # prompt: count_prompt's result, checked by check_request: not tokenized nor checked again
        step.text, step.tokens, step.stats   # new text (whole UTF-8 chars), new tokens, stats so far
        step.spec_mode, step.draft_max       # what was in effect at this step
        step.finish_reason                   # None until the last step: stop | length | timeout |
                                             # cancelled (request.time_budget; the cancel event)
        step.reply                           # a chat turn's last step: the assistant message
    # generate() raises EngineError (e.g. PromptTooLongError, KVCacheError) on failure; the engine
    # stays usable for the next request. generate() may be called from several threads: with
    # max_running 1 they take turns, else the scheduler runs them together (slots.py).
    engine.rolling_stats()                   # SpecStats over all requests so far (a copy)
    engine.model_info()                      # {"target": {...}, "draft": {...} or None}, each with
                                             # path, size_bytes, n_params, description,
                                             # n_gpu_layers, n_ctx, n_vocab, vocab_type
    engine.status()                          # /diagnostics key-values (backend, learned n-grams)
    engine.close(timeout=None)               # frees models, saves the dynamic n-gram cache and the
                                             # suffix history; idempotent;
                                             # never under a running step (see close())
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .chat.turn import template_file
from .config import EngineConfig, SpecConfig, expand_path
from .conversations import ConversationCache
from .drafters.base import Drafter
from .drafters.registry import build_drafters
from .errors import EngineError, PromptTooLongError
from .grammar.matcher import GrammarVocab, compiled_constraint
from .llama.features import eval_callback_for
from .llama.model import DecodeInterrupted, LlamaModel
from .llama.process import return_freed_memory
from .modes import mode_problem
from .policy.calibration import measure_costs
from .policy.costs import CostModel
from .policy.length import DraftLengthPolicy
from .propose import Drafting
from .prompts import ChatLayer, Prepared, prepare_prompt
from .request import CountedPrompt, GenerationRequest, Step
from .slots import SlotScheduler
from .stats import SpecStats
from .steps import MAX_VERIFY_ROWS, Steps


#: Several requests run at once only where a pass over their rows costs less than this share of
#: as many one-row passes (Engine._batching_decision).
BATCHING_MARGIN = 0.05


class Engine:
    """Target model + drafters + policy. See the module docstring for the API."""

    def __init__(self, config: EngineConfig, *, calibrate: bool = True) -> None:
        self.config = config
        self._spec: SpecConfig = config.spec
        self._lock = threading.Lock()  # the generation's (or the scheduler's); models are freed only under it
        self._closing = threading.Event()  # close() was called: stop the running generation
        self.close_error: Optional[BaseException] = None  # a failed deferred close (see close())
        self._faults: List[str] = []  # problems outside any request, for take_faults()
        # Tokenization runs in the caller's thread (a goal callback), outside the generation lock:
        # this lock keeps close() from freeing the model under it.
        self._vocab_lock = threading.Lock()
        self._freed = False
        self.costs = CostModel()
        self.drafters: Dict[str, Drafting] = {}
        self._scheduler: Optional[SlotScheduler] = None  # several requests at once (slots.py)
        n_slots = config.max_running
        # recent conversations' KV (conversations.py)
        self.conversations = ConversationCache(config.chat.conversation_cache_bytes)
        # A window-sized sliding-window cache (LlamaModel): the target rolls back only the
        # rejected tokens of its last pass, and prompt reuse checks the window. Safe only while
        # every verify pass is one llama.cpp batch: with a smaller n_batch, the full cache. The
        # window cache's cell order depends on the rollback history, so wherever bit-identical
        # output is promised (the exact build, F16/F32 weights) the backend keeps the full cache.
        # Several sequences keep the full cache too: each rolls back its own rows of a shared pass,
        # and llama.cpp warns that a window cache shared by sequences can cost speed.
        one_batch = min(config.target.n_batch, config.target.n_ctx) >= MAX_VERIFY_ROWS
        full_swa_cache = None if one_batch and n_slots == 1 else True
        # an EAGLE-3 head over a gemma3 target: its features are copied by an eval callback, a
        # context parameter (engine/llama/features.py); None otherwise
        self.target = LlamaModel(config.target, full_swa_cache=full_swa_cache, n_seq=n_slots,
                                 eval_callback=eval_callback_for(config.target, config.draft))
        # a request's start, prompt, steps and end (steps.py), driven by generate() or the scheduler
        self._steps = Steps(self.target, self.costs, self.conversations, lambda: self._spec, self._closing,
                            self._faults)
        try:  # the draft model first: if it cannot draft for the target, no cache is loaded (or saved)
            if n_slots > 1 and self.target.n_batch < MAX_VERIFY_ROWS * n_slots:
                raise ValueError(
                    f"max_running {n_slots} needs n_batch >= {MAX_VERIFY_ROWS * n_slots} (each running "
                    f"request's step may add {MAX_VERIFY_ROWS} rows to one pass); n_batch is "
                    f"{self.target.n_batch}")
            # every registered kind the config asks for (drafters/registry.py), the model first
            for drafter in build_drafters(config, self.target, n_slots):
                self._add_drafter(drafter)
            # chat turns: the template (a file's, loaded now: a bad file fails the load; else the
            # model's own, read at the first turn)
            template = template_file(expand_path(config.chat.template_path)) if config.chat.template_path else None
            self._chat = ChatLayer(self.target, template)
            if config.prepare_grammar:
                self._steps.grammar_vocab = GrammarVocab.of(self.target)
        except BaseException:
            self.close()
            raise
        if calibrate:
            self.calibrate()
        if n_slots > 1:
            slots = [(self.target.sequence(0), self.drafters)]
            slots += [(self.target.sequence(seq), self._slot_drafters(seq)) for seq in range(1, n_slots)]
            self._scheduler = SlotScheduler(self._steps, slots, self._lock, self._free_after_close,
                                            config.prompt_chunk)
            self._scheduler.limit, self._scheduler.why = self._batching_decision(n_slots)

    def _add_drafter(self, drafter: Drafter) -> None:
        self.drafters[drafter.name] = self._drafting(drafter)

    def _drafting(self, drafter: Drafter) -> Drafting:
        policy = DraftLengthPolicy(drafter.name, self.costs, probe_new_requests=drafter.cheap_to_probe)
        return Drafting(drafter, policy)

    def _slot_drafters(self, seq: int) -> Dict[str, Drafting]:
        """The drafters of slot ``seq`` (several requests at once): each of the engine's drafters
        for another request (Drafter.for_slot: what they learn is shared), with policies of their
        own (acceptance is the request's text's; the costs are the device's, shared)."""
        return {name: self._drafting(d.drafter.for_slot(seq)) for name, d in self.drafters.items()}

    def _batching_decision(self, n_slots: int) -> Tuple[int, str]:
        """How many requests to run at once, and why: all the slots, unless the calibration found
        a pass over ``n_slots`` rows as dear as that many one-row passes (then one at a time: never
        slower in total than serving them one after another). Not measured: all the slots."""
        one, many = self.costs.verify_cost(1), self.costs.verify_cost(n_slots)
        if not one or not many:
            return n_slots, "pass costs not measured"
        ratio = many / one
        told = f"a pass over {n_slots} rows costs {ratio:.2f}x a pass over one, measured at load"
        if ratio >= n_slots * (1.0 - BATCHING_MARGIN):
            return 1, f"{told}: batching does not pay here, one at a time"
        return n_slots, told

    @property
    def max_running(self) -> int:
        """Requests served at once: ``EngineConfig.max_running``, or 1 where a pass over that many
        rows was measured to cost as much as that many passes of one (batching would not pay)."""
        scheduler = self._scheduler
        return 1 if scheduler is None else scheduler.limit

    #: The most rows one request's step adds to a target pass.
    max_rows_per_request = MAX_VERIFY_ROWS

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- configuration --------------------------------------------------------------------------
    @property
    def spec(self) -> SpecConfig:
        return self._spec

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    @property
    def draft(self) -> Optional[Drafter]:
        """The drafter that runs the model of ``draft.model_path`` (a draft model, an assistant),
        None without one."""
        return next((d.drafter for d in self.drafters.values() if d.drafter.model_info() is not None), None)

    @property
    def warnings(self) -> List[str]:
        """Problems the drafters recovered from while loading (e.g. a corrupt cache moved aside)."""
        return [w for d in self.drafters.values() for w in d.drafter.warnings]

    def take_faults(self) -> List[str]:
        """Problems outside any request since the last call (a periodic save of the learned cache
        failed; a deferred close failed), for the owner to report; never a request's error."""
        faults = list(self._faults)  # the list is shared with the steps (a drafter's failed save)
        del self._faults[:len(faults)]
        return faults

    def dynamic_ngrams(self) -> int:
        """N-grams in the lookup drafter's dynamic (learned) cache; 0 without one."""
        return int(self._drafter_status().get("dynamic cache n-grams", 0))

    def _drafter_status(self) -> Dict[str, Any]:
        """The drafters' own key-values for /diagnostics (Drafter.status)."""
        values: Dict[str, Any] = {}
        for drafting in self.drafters.values():
            values.update(drafting.drafter.status())
        return values

    def status(self) -> Dict[str, Any]:
        """Key-values for /diagnostics: the backend, the learned lookup cache's size, the
        conversations kept, and with several requests at once how many run and how full the
        passes are."""
        values: Dict[str, Any] = {"backend": "local", "served by": "local",
                                  "dynamic cache n-grams": 0, **self._drafter_status(),
                                  "conversations kept": len(self.conversations),
                                  "conversations MiB": round(self.conversations.bytes / (1 << 20), 1),
                                  "conversations restored": self.conversations.restored}
        scheduler = self._scheduler
        if scheduler is not None:
            counts = scheduler.counts
            values.update({
                "scheduler": "running" if scheduler.alive or self._closing.is_set() else "stopped",
                "requests running": f"{scheduler.running()} of {scheduler.limit}",
                "requests at once": scheduler.why,
                "requests per pass": round(counts.requests_per_pass, 2),
                "rows per pass": round(counts.rows_per_pass, 2)})
        return values

    def check_spec(self, spec: SpecConfig) -> str:
        """Why ``spec`` cannot be used here ('' if it can)."""
        return mode_problem(spec.mode, self.drafters)

    def update_spec(self, spec: SpecConfig) -> None:
        """Use ``spec`` from the next step on (of a running generation too); never reloads models.
        Thread-safe: a step reads the spec once, and drafters get it with each proposal."""
        reason = self.check_spec(spec)
        if reason:
            raise ValueError(reason)
        self._spec = spec

    # -- requests -------------------------------------------------------------------------------
    def prompt_tokens(self, request: GenerationRequest) -> List[int]:
        """The request's prompt tokens (templated); thread-safe, also against close() (raises
        EngineError once the engine is closed, never touches a freed model)."""
        return list(self._prompt(request).tokens)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self._prompt(request).tokens)

    def count_prompt(self, request: GenerationRequest) -> CountedPrompt:
        prepared = self._prompt(request)
        return CountedPrompt(len(prepared.tokens), prepared.tokens, prepared, prepared.constraint)

    def _prompt(self, request: GenerationRequest) -> Prepared:
        """The request's prompt prepared for the loop (prompts.py: a chat turn rendered by its
        template, or the prompt's tokens; the constraint compiled: ValueError / TemplateError with
        the reason, a refusal). Under the vocabulary lock (the caller's thread: a goal callback)."""
        with self._vocab_lock:
            if self._freed:
                raise EngineError("the engine is closed")
            return prepare_prompt(request, self.target, self._chat)

    def check_request(self, request: GenerationRequest, n_prompt_tokens: Optional[int] = None) -> None:
        """Raise PromptTooLongError or ValueError (see the module docstring); ``n_prompt_tokens``
        saves tokenizing the prompt again."""
        n_prompt = self.count_prompt_tokens(request) if n_prompt_tokens is None else n_prompt_tokens
        self._check_fits(request, n_prompt)
        # the grammar's shape and llguidance's check, without the model (grammar.py: bounded, and
        # cached by text; count_prompt compiled it already where it was called)
        compiled_constraint(request.grammar, request.json_schema)

    def _check_fits(self, request: GenerationRequest, n_prompt: int) -> None:
        """What check_request checks besides the constraint: the context, the request's mode."""
        if n_prompt + request.max_tokens > self.n_ctx:
            raise PromptTooLongError(
                f"prompt of {n_prompt} tokens + max_tokens {request.max_tokens} exceeds the context "
                f"of {self.n_ctx} tokens: shorten the prompt or lower max_tokens")
        reason = self.check_spec(replace(self._spec, mode=request.spec_mode or self._spec.mode))
        if reason:
            raise ValueError(reason)

    def rolling_stats(self) -> SpecStats:
        return self._steps.rolling_stats()

    def model_info(self) -> dict:
        draft = self.draft
        return {"target": self.target.model_info(),
                "draft": draft.model_info() if draft is not None else None}

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancel: Optional[threading.Event] = None,
                 prompt: Optional[CountedPrompt] = None) -> Iterator[Step]:
        """Yield one Step per target pass; see the module docstring."""
        if self._scheduler is not None:  # several at once: the scheduler's rounds make the steps
            yield from self._scheduler.generate(request, self._checked_prompt(request, prompt), cancel)
            return
        with self._lock:
            if self._closing.is_set():
                raise EngineError("the engine is closed")
            try:
                yield from self._generate(request, cancel, prompt)
            finally:
                if self._closing.is_set():  # close() gave up waiting: free the models here
                    self._free_after_close()

    def _checked_prompt(self, request: GenerationRequest, counted: Optional[CountedPrompt]) -> CountedPrompt:
        """The request's counted prompt: ``counted`` (the caller checked the request), else counted
        and checked here (a chat request's carries its turn; a constrained one its constraint)."""
        if counted is None or counted.prepared is None:
            counted = self.count_prompt(request)  # the constraint compiled and checked there
            self._check_fits(request, counted.n_tokens)
        return counted

    def _generate(self, request: GenerationRequest, cancel: Optional[threading.Event],
                  counted: Optional[CountedPrompt]) -> Iterator[Step]:
        steps = self._steps
        counted = self._checked_prompt(request, counted)
        state = steps.start_request(request, counted, cancel, self.target, self.drafters)
        try:
            try:
                first = steps.prompt_pass(state, cancel)
            except DecodeInterrupted:  # cancelled, closing or out of time between two prompt chunks
                yield state.step(self._spec, "cancelled" if steps.stop_requested(cancel) else "timeout")
                return
            tokens, source, spec = (first,), None, self._spec
            while True:  # each pass's tokens become a Step: the prompt pass's first, then each step's
                step = state.emit(tokens, spec, source)  # labelled by the settings the step used
                yield step
                if step.finish_reason is not None:
                    return
                if steps.stop_requested(cancel):  # set while the consumer held the step
                    yield state.step(spec, "cancelled")
                    return
                planned, tokens = steps.step_alone(state)
                spec, source = planned.spec, planned.proposal.draft.source or None
        except BaseException:
            state.kv.clear()  # the KV cache may not hold what kv_tokens says: reuse none of it
            raise
        finally:
            steps.end_request(state)

    # -- calibration and teardown ---------------------------------------------------------------
    def calibrate(self, sizes: Sequence[int] = (), context_len: int = 64, repeats: int = 2,
                  warmup: int = 2) -> Dict[int, float]:
        """Measure the target's pass cost per batch size on this device (seeds the cost model);
        see policy/calibration.py."""
        return measure_costs(self.target, [d.drafter for d in self.drafters.values()], self.costs,
                             self._spec.draft_max, sizes, context_len, repeats, warmup)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Free models and persist the dynamic n-gram cache (idempotent). Never frees a model while
        a generation runs: the running generation stops at its next step or prompt chunk, and
        close waits for it up to ``timeout`` seconds (None = as long as it takes). True if the
        engine is freed on return; False if the wait timed out, in which case the generation frees
        the engine itself when its step ends (a failure then lands in ``close_error``).

        Every model is freed even if a drafter's close fails (a cache save on a full or read-only
        disk); the first such failure is then raised, for the caller to report.
        """
        self._closing.set()
        if self._scheduler is not None:
            self._scheduler.wake()  # its rounds end; its thread frees the models as it leaves
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            self._free()
        finally:
            self._lock.release()
        return True

    def _free_after_close(self) -> None:
        """close() gave up waiting for the running generation, which has now ended: free the
        models here (a failure is kept in ``close_error`` and the faults, for the owner to report)."""
        try:
            self._free()
        except Exception as exc:  # noqa: BLE001  kept for the owner to report
            self.close_error = exc
            self._faults.append(f"closing the engine after its last step failed: {exc}")

    def _free(self) -> None:
        """Free models, save the dynamic cache; the generation lock is held (or never used)."""
        with self._vocab_lock:  # waits for a tokenization in flight; refuses later ones
            self._freed = True
        steps = getattr(self, "_steps", None)
        if steps is not None:  # their tokenizers call into the vocabulary freed below
            steps.grammar_vocab = None
        chat = getattr(self, "_chat", None)
        if chat is not None:
            chat.close()
        self.conversations.clear()
        drafters, self.drafters = list(self.drafters.values()), {}
        errors: List[BaseException] = []
        for drafting in reversed(drafters):  # the n-gram caches first, then the draft model
            try:
                drafting.drafter.close()
            except Exception as exc:  # noqa: BLE001  freeing the rest comes first
                errors.append(exc)
        if getattr(self, "target", None) is not None:
            self.target.close()
        return_freed_memory()
        if errors:
            raise errors[0]
