"""Plain data of the engine: configuration, requests, drafts, steps, errors; the drafter protocol.

Every config is a frozen dataclass validated in ``__post_init__`` with a message a user can act on
(``ValueError``). Nothing here imports llama_cpp, so the node can validate input without a model.
"""
from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Optional, Protocol, Sequence, Tuple

from .stats import SpecStats

if TYPE_CHECKING:  # numpy in annotations only: configs validate without it
    import numpy as np

#: Speculative modes. ``draft+lookup`` tries the n-gram drafter, then the draft model, in that
#: order; ``auto`` is always adaptive and tries them best predicted speedup first (or drafts nothing);
#: ``mtp`` drafts with a Gemma 4 assistant (engine/mtp.py), which ``auto`` also tries.
SPEC_MODES: Tuple[str, ...] = ("off", "draft", "lookup", "draft+lookup", "auto", "mtp")
#: Modes that cannot run without a draft model (``auto`` does without one).
DRAFT_MODES: Tuple[str, ...] = ("draft", "draft+lookup")
#: Modes that cannot run without a Gemma 4 MTP assistant in ``draft.model_path`` (engine/mtp.py).
MTP_MODES: Tuple[str, ...] = ("mtp",)
#: Verification rules. ``exact``: accept while the target's own sample equals the draft (lossless
#: for any drafter). ``rejection``: Leviathan/Chen min(1, p/q) with residual resampling.
VERIFICATIONS: Tuple[str, ...] = ("exact", "rejection")


class EngineError(RuntimeError):
    """Base class of the engine's errors; the message is meant for a user or operator."""


class ModelLoadError(EngineError):
    """A model file is missing, unreadable, not a GGUF, or does not fit in memory."""


class VocabMismatchError(EngineError):
    """The draft model's vocabulary differs from the target's (llama.cpp's compatibility rule)."""


class PromptTooLongError(EngineError):
    """The prompt does not fit in the context after reserving room for ``max_tokens``."""


class CacheFormatError(EngineError):
    """An n-gram cache file is truncated or not in llama.cpp's n-gram cache format."""


class KVCacheError(EngineError):
    """llama.cpp refused to remove KV cells (rollback failed); the sequence state is unknown."""


def expand_path(path: str) -> str:
    """``~`` and ``$VARS`` expanded; empty stays empty."""
    return os.path.expandvars(os.path.expanduser(path)) if path else ""


@dataclass(frozen=True)
class ModelConfig:
    """One GGUF model as llama.cpp loads it."""

    path: str  # GGUF file; '~' and $VARS are expanded
    n_gpu_layers: int = 0  # layers offloaded to the GPU; -1 = all
    n_ctx: int = 2048  # context length in tokens (prompt + generation)
    n_batch: int = 512  # largest batch llama_decode gets (prompt chunks)
    n_threads: int = 0  # CPU threads; 0 = all cores
    flash_attn: bool = False  # flash attention: faster, but not batch-invariant (no bit-exact parity)
    seed: int = 0  # context seed (our sampling is seeded per request; kept for llama.cpp)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("model path is empty: pass the path of a .gguf file")
        if self.n_ctx < 16:
            raise ValueError(f"n_ctx={self.n_ctx}: must be >= 16 tokens")
        if self.n_batch < 1:
            raise ValueError(f"n_batch={self.n_batch}: must be >= 1")
        if self.n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers={self.n_gpu_layers}: use -1 for all layers, or >= 0")
        if self.n_threads < 0:
            raise ValueError(f"n_threads={self.n_threads}: use 0 for all cores, or >= 1")

    @property
    def resolved_path(self) -> str:
        return expand_path(self.path)


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs. ``mode`` and ``draft_max`` may change while the engine runs."""

    mode: str = "lookup"  # one of SPEC_MODES
    draft_max: int = 8  # K: the most tokens drafted per step (the policy may use fewer)
    draft_min: int = 0  # n_min: a model draft shorter than this is dropped (0/1 = keep any)
    p_min: float = 0.75  # model drafting stops when the draft's top probability falls below this
    adaptive: bool = True  # adapt K to measured acceptance and cost (False: always draft_max)
    verification: str = "exact"  # one of VERIFICATIONS

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"spec mode {self.mode!r}: expected one of {', '.join(SPEC_MODES)}")
        if not 1 <= self.draft_max <= 64:
            raise ValueError(f"draft_max={self.draft_max}: must be in [1, 64]")
        if not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(f"draft_min={self.draft_min}: must be in [0, draft_max={self.draft_max}]")
        if not (0.0 <= self.p_min <= 1.0):
            raise ValueError(f"p_min={self.p_min}: must be in [0, 1]")
        if self.verification not in VERIFICATIONS:
            raise ValueError(
                f"verification {self.verification!r}: expected one of {', '.join(VERIFICATIONS)}")


@dataclass(frozen=True)
class LookupConfig:
    """The n-gram lookahead caches (llama.cpp's lookup decoding)."""

    static_path: str = ""  # static cache built by gemma-spec-lookup-create / llama-lookup-create
    dynamic_path: str = ""  # dynamic cache: loaded if present, saved on close; '' = in memory only
    #: if set, ``dynamic_path`` must lie inside this folder (after resolving links): the learned
    #: cache is the one file the engine writes, so a path set by a peer cannot create files elsewhere
    cache_dir: str = ""
    ngram_min: int = 1  # shortest context n-gram tried
    ngram_max: int = 4  # longest context n-gram tried (llama.cpp's cache format allows <= 4)
    #: the dynamic cache keeps at most this many n-grams (~0.4 KB each in memory): past it, the
    #: n-grams seen least often (the oldest among equals) are evicted, down to 90 % of it
    dynamic_max_ngrams: int = 100_000
    #: seconds between atomic saves of the dynamic cache while serving; 0 = only on close
    save_period: float = 300.0

    def __post_init__(self) -> None:
        if self.dynamic_max_ngrams < 1:
            raise ValueError(f"dynamic_max_ngrams={self.dynamic_max_ngrams}: must be >= 1")
        if not math.isfinite(self.save_period) or self.save_period < 0:
            raise ValueError(f"save_period={self.save_period}: must be >= 0 seconds (0 = on close)")
        if not 1 <= self.ngram_min <= self.ngram_max <= 4:
            raise ValueError(
                f"lookup n-gram sizes {self.ngram_min}..{self.ngram_max}: need 1 <= min <= max <= 4")
        if self.cache_dir and self.dynamic_path:
            folder = os.path.realpath(expand_path(self.cache_dir))
            target = os.path.realpath(expand_path(self.dynamic_path))
            if os.path.commonpath([folder, target]) != folder:
                raise ValueError(
                    f"lookup.dynamic_path {self.dynamic_path!r} is outside lookup.cache_dir "
                    f"{self.cache_dir!r}: the learned cache is the one file the node writes and it "
                    "stays in that folder (lookup.cache_dir is set at launch only)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an :class:`~gemma_spec_ros.engine.engine.Engine`."""

    target: ModelConfig
    draft: Optional[ModelConfig] = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)

    def __post_init__(self) -> None:
        if self.spec.mode in DRAFT_MODES and self.draft is None:
            raise ValueError(f"spec mode {self.spec.mode!r} needs a draft model: set draft.model_path")
        if self.spec.mode in MTP_MODES and self.draft is None:
            raise ValueError(f"spec mode {self.spec.mode!r} needs a Gemma 4 assistant: set "
                             f"draft.model_path to a gemma4-assistant GGUF")


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how to reach an OpenAI-compatible inference server (engine/remote/)."""

    url: str  # base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)
    model: str = ""  # "model" of each request; '' = the server's default model
    api_key_env: str = ""  # NAME of the environment variable holding the API key; '' = no key
    connect_timeout: float = 2.0  # seconds to connect; also the limit of tokenizer and probe calls
    read_timeout: float = 60.0  # longest wait for the next data event of a stream (the first too);
    #                            keep-alive comments (": ping") do not count
    probe_period: float = 2.0  # seconds between reachability/RTT probes and /metrics reads; 0 = off
    n_ctx: int = 0  # context length for goal checks; 0 = what the server reports (else no check)
    #: the node's limits.max_prompt_tokens as of configure, checked on the exact count at start
    #: (the goal check has only the lower-bound estimate); 0 = no limit
    max_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote.url {self.url!r}: expected http://HOST:PORT or https://HOST:PORT")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"remote.{name}={value}: must be > 0 seconds")
        if self.probe_period < 0 or self.n_ctx < 0 or self.max_prompt_tokens < 0:
            raise ValueError("remote.probe_period, remote.n_ctx and max_prompt_tokens must be >= 0")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"remote.api_key_env names {self.api_key_env!r}, which is not set in "
                             "the node's environment: export it, or set remote.api_key_env to ''")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampler. ``temperature == 0`` is greedy (top-k/top-p are then irrelevant)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1): drop tokens below min_p * p(top token)
    seed: int = -1  # -1 = fresh entropy

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be finite and >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = no limit)")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. ``spec_mode`` None means the engine's current mode."""

    prompt: str
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system_prompt: str = ""
    use_chat_template: bool = False
    stop: Tuple[str, ...] = ()
    spec_mode: Optional[str] = None
    #: seconds from the start of generate() after which the request ends with finish_reason
    #: ``timeout`` and its text so far (checked at step boundaries); 0 = no limit
    time_budget: float = 0.0
    #: keep the KV cache of the previous request's common prefix and evaluate only the rest
    #: (bit-identical with F16/F32 weights; quantized weights may differ after a near-tie, since
    #: the batch shapes change); False = evaluate the whole prompt from an empty cache
    reuse_prompt: bool = True
    #: constrained output (engine/grammar.py, llguidance): a GBNF grammar (llama.cpp's format, rule
    #: ``root``), or a JSON Schema (text); at most one of the two
    grammar: str = ""
    json_schema: str = ""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt is empty")
        if self.grammar and self.json_schema:
            raise ValueError("grammar and json_schema are both set: give at most one of the two")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if not math.isfinite(self.time_budget) or self.time_budget < 0:
            raise ValueError(f"time_budget={self.time_budget}: must be finite and >= 0 (0 = none)")
        if self.spec_mode is not None and self.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec mode {self.spec_mode!r}: expected one of {', '.join(SPEC_MODES)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def plain_prompt(self) -> str:
        """The text of a request without the chat template: the system prompt, a blank line, the
        prompt (the local engine tokenizes it; a remote server gets it as its raw prompt).

        >>> GenerationRequest("Hi", system_prompt="Be brief.").plain_prompt
        'Be brief.\\n\\nHi'
        """
        if self.system_prompt:
            return self.system_prompt + "\n\n" + self.prompt
        return self.prompt


@dataclass(frozen=True)
class CountedPrompt:
    """A request's prompt as one engine counted it (``count_prompt``).

    ``tokens`` are the token ids from an engine that tokenizes here (None from one that sends text,
    whose ``n_tokens`` may be an estimate). Handed back to that engine's ``generate`` after its
    ``check_request`` passed, they spare tokenizing and checking the request a second time.
    """

    n_tokens: int
    tokens: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class Draft:
    """Tokens a drafter proposes to follow the context. ``()`` = nothing to propose.

    ``probs[i]`` is the draft distribution q over the vocabulary at position i (model drafts, used by
    ``rejection`` verification); None for n-gram drafts, which are deterministic.

    ``evidence[i]``: what token i rests on, a hashable class (n-gram lookup: which cache, how long
    the n-gram, whether its continuation was unanimous); None from drafters that do not say. The
    policy learns acceptance per class and cuts each draft where its expected gain peaks
    (:meth:`~gemma_spec_ros.engine.policy.DraftLengthPolicy.cut`).
    """

    tokens: Tuple[int, ...] = ()
    probs: Optional[Tuple["object", ...]] = None  # tuple of numpy float arrays, one per token
    source: str = ""  # the drafter that produced it (its ``name``): "draft" | "lookup"
    evidence: Optional[Tuple[Hashable, ...]] = None

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft()


@dataclass(frozen=True)
class Step:
    """What one engine step produced. The last step of a generation has ``finish_reason`` set."""

    tokens: Tuple[int, ...]  # tokens emitted at this step (may be empty, e.g. held by a stop string)
    text: str  # new text since the previous step: whole UTF-8 characters, stop strings excluded
    stats: SpecStats  # the request's stats so far (a snapshot; safe to keep)
    spec_mode: str  # mode in effect at this step ("auto:lookup" style when auto chose)
    draft_max: int  # K in effect at this step
    finish_reason: Optional[str] = None  # stop | length | timeout | cancelled on the last step
    #: on the last step, what the finish reason alone does not say (e.g. max_tokens ran out before
    #: the request's grammar was complete: the text is not a whole match); else ''
    detail: str = ""


class Drafter(Protocol):
    """What every drafter implements; the engine calls nothing else.

    Per request: ``begin`` once, ``propose`` once per step, ``end`` once. Per engine: ``warm_up``
    (calibration) and ``close``. A drafter keeps no acceptance counters: the engine's SpecStats and
    its per-drafter draft-length policy do.
    """

    name: str  # "lookup" | "draft": the key of the mode table and Draft.source
    cheap_to_probe: bool  # a probe costs ~nothing (n-gram lookup); a model first catches up on the context
    #: its drafts run no model and carry ``Draft.evidence`` (n-gram lookup): with ``spec.adaptive``
    #: it proposes K tokens at every step and its policy cuts each draft (policy.py); the whole
    #: drafts are checked against the emitted tokens (engine/uncut.py)
    cuts_drafts: bool

    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional["np.random.Generator"] = None) -> None:
        """A new request starts with these prompt tokens (per-request state resets here).

        ``sampling`` and ``rng`` are given when the request verifies by rejection sampling: a drafter
        that can, then samples its drafts from that sampler and returns their distributions
        (``Draft.probs``); without them it drafts deterministically (greedy, or by n-gram counts).
        """

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens to follow ``context`` (prompt + all accepted tokens), under the
        limits of ``spec`` (``p_min``, ``draft_min``) in effect at this step."""

    def end(self, tokens: Sequence[int]) -> None:
        """The request finished with these tokens (prompt + generated); learn from them."""

    def warm_up(self, filler: Sequence[int], max_rows: int, passes: int) -> None:
        """Run the passes drafting uses, untimed, so that measured draft costs are steady-state ones."""

    def model_info(self) -> Optional[dict]:
        """The model this drafter runs (path, size, ...), None if it runs none."""

    def close(self) -> None:
        """Free resources and persist what should survive (dynamic caches)."""
