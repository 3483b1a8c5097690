"""The engine: target model + drafters + policy, serving one generation at a time.

Public API (the node and the bench use only this):

    engine = Engine(config)                  # loads models; raises ModelLoadError, VocabMismatchError,
                                             # CacheFormatError (all EngineError) or ValueError
    engine.spec                              # current SpecConfig (frozen)
    engine.check_spec(spec) -> str           # '' if usable, else the reason (e.g. no draft model)
    engine.update_spec(spec)                 # thread-safe; raises ValueError(reason); next step uses it
    engine.set_mode("lookup"); engine.set_draft_max(4)   # shortcuts for update_spec(replace(...))
    engine.count_prompt_tokens(request)      # tokens of the (templated) prompt; thread-safe, ~ms
    engine.check_request(request)            # raises PromptTooLongError if prompt + max_tokens > n_ctx,
                                             # ValueError if its spec_mode cannot be used here
    engine.n_ctx                             # target context length (tokens)
    for step in engine.generate(request, cancel=threading.Event()):
        step.text, step.tokens, step.stats   # new text (whole UTF-8 chars), new tokens, stats so far
        step.spec_mode, step.draft_max       # what was in effect at this step
        step.finish_reason                   # None until the last step: stop | length | timeout |
                                             # cancelled (request.time_budget, cancel)
    # generate() raises EngineError (e.g. PromptTooLongError, KVCacheError) on failure; the engine
    # stays usable for the next request. One generate() at a time (the node serialises).
    engine.rolling_stats()                   # SpecStats over all requests so far (a copy)
    engine.model_info()                      # {"target": {...}, "draft": {...} or None}, each with
                                             # path, size_bytes, n_params, description,
                                             # n_gpu_layers, n_ctx, n_vocab, vocab_type
    engine.close()                           # frees models, saves the dynamic n-gram cache; idempotent
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .backend import LlamaBackend, Utf8Stream
from .draft_model import DraftModelDrafter
from .policy import CostModel, Decision, DraftLengthPolicy
from .sampling import Sampler, make_rng
from .stats import SpecStats, Stopwatch, now
from .types import (EMPTY_DRAFT, Draft, EngineConfig, GenerationRequest, PromptTooLongError,
                    SpecConfig)
from .verify import verify_exact, verify_rejection


@dataclass(frozen=True)
class Step:
    """What one engine step produced. The last step of a generation has ``finish_reason`` set."""

    tokens: Tuple[int, ...]  # tokens emitted at this step (may be empty, e.g. held by a stop string)
    text: str  # new text since the previous step: whole UTF-8 characters, stop strings excluded
    stats: SpecStats  # the request's stats so far (a snapshot; safe to keep)
    spec_mode: str  # mode in effect at this step ("auto:lookup" style when auto chose)
    draft_max: int  # K in effect at this step
    finish_reason: Optional[str] = None  # stop | length | timeout | cancelled on the last step



#: Drafters tried per mode, in order: the first non-empty draft is verified.
_SOURCES: Dict[str, Tuple[str, ...]] = {
    "off": (),
    "draft": ("draft",),
    "lookup": ("lookup",),
    "draft+lookup": ("lookup", "draft"),
    "auto": ("lookup", "draft"),
}


class TextAssembler:
    """Tokens in, text out: whole UTF-8 characters, stop strings cut, text that might be the start
    of a stop string held back until it is known not to be.

    >>> class V:  # a vocabulary of single-character tokens
    ...     def token_bytes(self, t): return bytes([t])
    >>> a = TextAssembler(V(), ("END",))
    >>> a.push([ord(c) for c in "abE"]), a.push([ord(c) for c in "Nx"]), a.stopped
    ('ab', 'ENx', False)
    >>> a.push([ord(c) for c in "yEND!"]), a.stopped
    ('y', True)
    """

    def __init__(self, vocab, stop: Sequence[str]) -> None:
        self._vocab = vocab
        self._utf8 = Utf8Stream()
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False
        self.text = ""  # everything released so far

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._held += self._utf8.push(b"".join(self._vocab.token_bytes(t) for t in tokens))
        return self._release(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self._held += self._utf8.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        cut = min((i for i in (held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._held = held[:cut], ""
        elif final or not self._stop:
            out, self._held = held, ""
        else:  # keep the longest tail that is a proper prefix of some stop string
            keep = 0
            for s in self._stop:
                for n in range(min(len(s) - 1, len(held)), keep, -1):
                    if held.endswith(s[:n]):
                        keep = n
                        break
            out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        self.text += out
        return out


class Engine:
    """Target model + drafters + policy. See the module docstring for the API."""

    def __init__(self, config: EngineConfig, *, calibrate: bool = True) -> None:
        from .lookup import LookupDrafter

        self.config = config
        self._spec: SpecConfig = config.spec
        self._lock = threading.Lock()  # one generation at a time
        self._stats_lock = threading.Lock()
        self._rolling = SpecStats()
        self.target = LlamaBackend(config.target)
        self.draft: Optional[DraftModelDrafter] = None
        self.lookup: Optional[LookupDrafter] = None
        try:
            if config.draft is not None:
                self.draft = DraftModelDrafter(config.draft, self.target, p_min=config.spec.p_min,
                                               n_min=config.spec.draft_min)
            self.lookup = LookupDrafter(config.lookup)
        except BaseException:
            self.close()
            raise
        self.costs = CostModel()
        self.policies = {"lookup": DraftLengthPolicy("lookup", self.costs),
                         "draft": DraftLengthPolicy("draft", self.costs, probe_new_requests=False)}
        if calibrate:
            self.calibrate()

    # -- configuration --------------------------------------------------------------------------
    @property
    def spec(self) -> SpecConfig:
        return self._spec

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    def check_spec(self, spec: SpecConfig) -> str:
        """Why ``spec`` cannot be used here ('' if it can)."""
        if spec.mode in ("draft", "draft+lookup") and self.draft is None:
            return f"spec mode {spec.mode!r} needs a draft model, and none is configured (draft.model_path)"
        return ""

    def update_spec(self, spec: SpecConfig) -> None:
        """Use ``spec`` from the next step on (of a running generation too); never reloads models."""
        reason = self.check_spec(spec)
        if reason:
            raise ValueError(reason)
        if self.draft is not None:
            self.draft.set_limits(spec.p_min, spec.draft_min)
        self._spec = spec

    def set_mode(self, mode: str) -> None:
        self.update_spec(replace(self._spec, mode=mode))

    def set_draft_max(self, draft_max: int) -> None:
        self.update_spec(replace(self._spec, draft_max=draft_max))

    # -- requests -------------------------------------------------------------------------------
    def prompt_tokens(self, request: GenerationRequest) -> List[int]:
        text = request.prompt
        if request.use_chat_template:
            text = self.target.chat_prompt(request.prompt, request.system_prompt)
            return self.target.tokenize(text, add_special=True, parse_special=True)
        if request.system_prompt:
            text = request.system_prompt + "\n\n" + text
        return self.target.tokenize(text, add_special=True, parse_special=False)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self.prompt_tokens(request))

    def check_request(self, request: GenerationRequest, n_prompt: Optional[int] = None) -> None:
        n_prompt = self.count_prompt_tokens(request) if n_prompt is None else n_prompt
        if n_prompt + request.max_tokens > self.n_ctx:
            raise PromptTooLongError(
                f"prompt of {n_prompt} tokens + max_tokens {request.max_tokens} exceeds the context "
                f"of {self.n_ctx} tokens: shorten the prompt or lower max_tokens")
        reason = self.check_spec(replace(self._spec, mode=request.spec_mode or self._spec.mode))
        if reason:
            raise ValueError(reason)

    def rolling_stats(self) -> SpecStats:
        with self._stats_lock:
            snap = self._rolling.snapshot()
        snap.plain_token_time = self.costs.plain_token_time
        return snap

    def model_info(self) -> dict:
        return {"target": self.target.model_info(),
                "draft": self.draft.backend.model_info() if self.draft is not None else None}

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest,
                 cancel: Optional[threading.Event] = None) -> Iterator[Step]:
        """Yield one Step per target pass; see the module docstring."""
        with self._lock:
            yield from self._generate(request, cancel)

    def _generate(self, request: GenerationRequest, cancel: Optional[threading.Event]) -> Iterator[Step]:
        target = self.target
        prompt = self.prompt_tokens(request)
        self.check_request(request, len(prompt))
        sampler = Sampler(request.sampling)
        rng = make_rng(request.sampling.seed)
        stats = SpecStats(num_prompt_tokens=len(prompt))
        watch = Stopwatch(stats)
        text = TextAssembler(target, request.stop)
        eos_hit = False
        generated: List[int] = []
        t_request = now()
        try:
            with watch("prompt_time"):
                stats.num_prompt_tokens_reused = self._keep_prompt_prefix(prompt, request.reuse_prompt)
                rest = prompt[stats.num_prompt_tokens_reused:]
                rows = target.decode(rest, [len(rest) - 1])
                first = sampler.sample(rows[0], rng)
            stats.time_to_first_token = now() - t_request
            use_rejection = self._spec.verification == "rejection" and not sampler.greedy
            for drafter in self._drafters():
                drafter.begin(prompt)
            for policy in self.policies.values():
                policy.new_request()
            if self.draft is not None:
                self.draft.set_sampling(sampler if use_rejection else None,
                                        rng.spawn(1)[0] if use_rejection else None)
            context = list(prompt)
            pending = first
            step_tokens: Tuple[int, ...] = (first,)
            step_mode, step_k = self._mode_label(request, None), self._spec.draft_max
            while True:
                # emit what the last pass produced
                emitted: List[int] = []
                for token in step_tokens:
                    if len(generated) >= request.max_tokens:
                        break
                    if target.is_eog(token):
                        eos_hit = True
                        break
                    emitted.append(token)
                    generated.append(token)
                new_text = text.push(emitted)
                finish = None
                if text.stopped or eos_hit:
                    finish = "stop"
                elif len(generated) >= request.max_tokens or target.n_past + 1 >= self.n_ctx:
                    finish = "length"
                elif cancel is not None and cancel.is_set():
                    finish = "cancelled"
                elif request.time_budget and now() - t_request >= request.time_budget:
                    finish = "timeout"
                stats.num_generated_tokens = len(generated)
                if finish is not None:
                    new_text += text.flush()
                self._label_stats(stats, step_mode, step_k)
                yield Step(tuple(emitted), new_text, stats.snapshot(), step_mode, step_k, finish)
                if finish is not None:
                    break
                if cancel is not None and cancel.is_set():  # set while the consumer held the step
                    yield Step((), text.flush(), stats.snapshot(), step_mode, step_k, "cancelled")
                    break
                # one speculative step
                t_step = now()
                spec = self._spec
                mode = request.spec_mode or spec.mode
                room = self.n_ctx - target.n_past - 1
                k_cap = max(0, min(spec.draft_max, request.max_tokens - len(generated) - 1, room))
                context.append(pending)
                with watch("draft_time"):
                    draft, decision, source = self._propose(mode, spec, context, k_cap)
                batch = [pending] + list(draft.tokens)
                n_keep = target.n_past
                with watch("verify_time"):
                    rows, seconds = target.timed_decode(batch, range(len(batch)))
                self.costs.observe_verify(len(batch), seconds)
                with watch("sample_time"):
                    if use_rejection:
                        verdict = verify_rejection(rows, draft.tokens, draft.probs, sampler, rng)
                    else:
                        verdict = verify_exact(rows, draft.tokens, sampler, rng)
                target.rollback(n_keep + 1 + verdict.num_accepted)
                if draft.tokens:
                    stats.observe_draft(len(draft), verdict.num_accepted, source)
                    self.policies[source].observe(len(draft), verdict.num_accepted)
                    self._drafter(source).observe(len(draft), verdict.num_accepted)
                context.extend(verdict.tokens[:-1])
                pending = verdict.tokens[-1]
                step_tokens = verdict.tokens
                stats.num_steps += 1
                stats.num_step_tokens += len(verdict.tokens)
                stats.predicted_speedup = decision.predicted_speedup
                stats.generation_time += now() - t_step
                step_mode, step_k = self._mode_label(request, source), spec.draft_max
        except BaseException:
            target.clear()  # the KV cache may not hold what kv_tokens says: reuse nothing of it
            raise
        finally:
            stats.plain_token_time = self.costs.plain_token_time
            for drafter in self._drafters():
                drafter.end(prompt + generated)
            with self._stats_lock:
                self._rolling.merge(stats)

    def _keep_prompt_prefix(self, prompt: Sequence[int], reuse: bool) -> int:
        """Prompt tokens whose KV cache the previous request left (its common prefix with
        ``prompt``, less the last token, whose logits are needed); the rest is rolled back.

        With ``reuse`` False the cache is emptied: the whole prompt is evaluated in one batch, the
        same shapes whatever ran before (quantized logits depend slightly on batch shapes).
        """
        if not reuse:
            self.target.clear()
            return 0
        return self.target.reuse_prefix(prompt, keep_last=1)

    def _mode_label(self, request: GenerationRequest, source: Optional[str]) -> str:
        mode = request.spec_mode or self._spec.mode
        return f"auto:{source or 'off'}" if mode == "auto" else mode

    def _label_stats(self, stats: SpecStats, mode: str, draft_max: int) -> None:
        stats.spec_mode, stats.draft_max = mode, draft_max
        stats.verification = self._spec.verification
        stats.plain_token_time = self.costs.plain_token_time

    def _drafters(self) -> List:
        return [d for d in (self.lookup, self.draft) if d is not None]

    def _drafter(self, source: str):
        return self.lookup if source == "lookup" else self.draft

    def _propose(self, mode: str, spec: SpecConfig, context: List[int], k_cap: int):
        """The first non-empty draft of this mode's drafters, with the policy's decision."""
        plain = Decision(0, 1.0)
        if k_cap <= 0:
            return EMPTY_DRAFT, plain, None
        adaptive = spec.adaptive or mode == "auto"
        for source in _SOURCES[mode]:
            drafter = self._drafter(source)
            if drafter is None:
                continue
            decision = self.policies[source].decide(k_cap, adaptive)
            if decision.draft_len <= 0:
                continue
            t0 = now()
            draft: Draft = drafter.propose(context, decision.draft_len)
            if draft.tokens:
                self.costs.observe_draft(source, len(draft), now() - t0)
                return draft, decision, source
        return EMPTY_DRAFT, plain, None

    # -- calibration and teardown ---------------------------------------------------------------
    def calibrate(self, sizes: Sequence[int] = (), context_len: int = 64, repeats: int = 2,
                  warmup: int = 2) -> Dict[int, float]:
        """Measure the target's pass cost per batch size on this device (seeds the cost model).

        Every size first runs ``warmup`` untimed passes: the first passes of a batch shape are slower
        than the steady state (page faults of the memory-mapped weights on a CPU; kernel selection and
        CUDA-graph capture on a GPU, where a cold V(1) came out ~3x the steady one on an H200). A V(1)
        that is too high makes every draft look profitable, and in a speculative mode plain steps are
        rare, so the estimate would not be corrected by later measurements. The draft model, if any,
        is warmed up the same way (its cost is measured while drafting).
        """
        target = self.target
        sizes = sorted(set(sizes or (1, 2, 4, self._spec.draft_max + 1)))  # interpolated between
        context_len = max(1, min(context_len, self.n_ctx - max(sizes) - 1))
        def token(i: int) -> int:  # ordinary tokens of any vocabulary, past the first control ids
            return 3 + (997 + i) % max(1, target.n_vocab - 3)

        filler = [target.bos if target.bos >= 0 else token(0)] + [token(i) for i in range(context_len - 1)]
        if self.draft is not None:
            self.draft.warm_up(filler, max(sizes), warmup)
        target.clear()
        target.decode(filler, [])
        measured: Dict[int, float] = {}
        for n in sizes:
            batch = [token(context_len + i) for i in range(n)]
            for _ in range(warmup):
                target.decode(batch, range(n))
                target.rollback(context_len)
            best = math.inf
            for _ in range(repeats):
                _, seconds = target.timed_decode(batch, range(n))
                target.rollback(context_len)
                best = min(best, seconds)
            measured[n] = best
            self.costs.observe_verify(n, best)
        target.clear()
        return measured

    def close(self) -> None:
        """Free models and persist the dynamic n-gram cache (idempotent)."""
        for drafter in (self.lookup, self.draft):
            if drafter is not None:
                drafter.close()
        self.lookup = None
        self.draft = None
        if getattr(self, "target", None) is not None:
            self.target.close()
