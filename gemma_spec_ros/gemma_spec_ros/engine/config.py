"""The engine's configuration: frozen dataclasses validated in ``__post_init__``.

Every check raises ``ValueError`` with a message a user can act on. Nothing here imports
llama_cpp, so the node can validate input without a model.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from .modes import check_mode_name, needs_draft_slot


#: Verification rules. ``exact``: accept while the target's own sample equals the draft (lossless
#: for any drafter). ``rejection``: Leviathan/Chen min(1, p/q) with residual resampling.
VERIFICATIONS: Tuple[str, ...] = ("exact", "rejection")


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

    mode: str = "lookup"  # a row of the mode table (modes.py)
    draft_max: int = 8  # K: the most tokens drafted per step (the policy may use fewer)
    draft_min: int = 0  # n_min: a model draft shorter than this is dropped (0/1 = keep any)
    p_min: float = 0.75  # model drafting stops when the draft's top probability falls below this
    adaptive: bool = True  # adapt K to measured acceptance and cost (False: always draft_max)
    verification: str = "exact"  # one of VERIFICATIONS

    def __post_init__(self) -> None:
        check_mode_name(self.mode)
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
class SuffixConfig:
    """The suffix drafter's history and drafting rules (drafters/suffix.py).

    ``min_token_probability`` 0.6 and ``match_factor`` 3 (vLLM's defaults are 0.1 and 1): replayed
    over the traces (bench.trace_replay: planner, planner with its schema, agent loop), 0.3 gave
    2.89x / 2.91x / 3.84x plain against 2.81x / 2.86x / 3.82x with vLLM's; 0.6 then 2.98x / 3.06x /
    3.85x against 0.3's 2.98x / 2.93x / 3.84x (0.5: 2.98x / 3.01x; 0.7: 2.99x / 2.96x), the single-
    prompt suites in order 1.91x both: under a schema a draft is not cut by its evidence, and the
    drafter's own stop is its cut. Without a schema drafts past the first few tokens are cut by the
    policy anyway, so the drafter's own bounds matter less there than in vLLM.
    """

    #: the history file: loaded if present, saved periodically and on close; '' = in memory only
    history_path: str = ""
    #: if set, ``history_path`` must lie inside this folder (the learned cache's, lookup.cache_dir)
    cache_dir: str = ""
    #: tokens of earlier outputs kept, the oldest evicted first (at 65,536: 22 MiB, a propose
    #: ~0.1 ms, loading the file 0.7 s; bench.suffix_cost)
    history_max_tokens: int = 65_536
    #: longest match looked for, in tokens (the index keeps a table per level up to it)
    max_match: int = 32
    #: the newest occurrences of a match whose continuations are counted
    max_occurrences: int = 32
    #: a draft stops where the product of its tokens' estimated probabilities falls below this
    min_token_probability: float = 0.6
    #: a draft is at most this many times as long as the match it starts from (0 = no such bound)
    match_factor: float = 3.0
    #: the prompts join the history too, not only the outputs
    keep_prompts: bool = False
    #: seconds between atomic saves of the history while serving; 0 = only on close
    save_period: float = 300.0

    def __post_init__(self) -> None:
        if self.history_max_tokens < 0:
            raise ValueError(f"history_max_tokens={self.history_max_tokens}: must be >= 0")
        if self.max_match < 1:
            raise ValueError(f"max_match={self.max_match}: must be >= 1 token")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences={self.max_occurrences}: must be >= 1")
        if not 0.0 <= self.min_token_probability <= 1.0:
            raise ValueError(f"min_token_probability={self.min_token_probability}: must be in [0, 1]")
        if not math.isfinite(self.match_factor) or self.match_factor < 0:
            raise ValueError(f"match_factor={self.match_factor}: must be >= 0 (0 = no bound)")
        if not math.isfinite(self.save_period) or self.save_period < 0:
            raise ValueError(f"save_period={self.save_period}: must be >= 0 seconds (0 = on close)")
        if self.cache_dir and self.history_path:
            folder = os.path.realpath(expand_path(self.cache_dir))
            target = os.path.realpath(expand_path(self.history_path))
            if os.path.commonpath([folder, target]) != folder:
                raise ValueError(
                    f"suffix.history_path {self.history_path!r} is outside the cache folder "
                    f"{self.cache_dir!r}: the node writes only there")


#: The most requests one engine serves at once (slots): each adds up to 65 rows to a pass.
MAX_RUNNING = 4


@dataclass(frozen=True)
class ChatConfig:
    """Chat turns (engine/chat/): the template that renders them, and the conversations' KV kept
    between turns (engine/conversations.py)."""

    #: a Jinja chat template file used instead of the model's own (``tokenizer.chat_template``), e.g.
    #: for a base model without one; '' = the model's own
    template_path: str = ""
    #: host memory for snapshots of recent conversations' KV (a follow-up turn after another
    #: conversation's evaluates only its new tokens); least recently used out first; 0 = none kept
    conversation_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.conversation_cache_bytes < 0:
            raise ValueError(f"conversation_cache_bytes={self.conversation_cache_bytes}: must be >= 0 "
                             "(0 = keep no conversation's KV)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an :class:`~gemma_spec_ros.engine.engine.Engine`."""

    target: ModelConfig
    draft: Optional[ModelConfig] = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    #: requests served at once, each in its own sequence of the target, their steps in one pass
    #: (engine/slots.py); 1 = one at a time, as the loop in engine.py runs them
    max_running: int = 1
    #: prompt tokens a starting request adds to a pass that also carries other requests' steps
    prompt_chunk: int = 64
    #: build the grammar engine's tokenizer of the target's vocabulary at load rather than at the
    #: first constrained request or chat turn: llguidance takes ~2.6 s for Gemma's 262,144 tokens on
    #: a 2-core CPU and holds Python's GIL for ~1.6 s of it, so every other thread of the process
    #: (a node's executor: goal responses, feedback, /diagnostics) stops meanwhile
    prepare_grammar: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_running <= MAX_RUNNING:
            raise ValueError(f"max_running={self.max_running}: must be in [1, {MAX_RUNNING}]")
        if self.prompt_chunk < 1:
            raise ValueError(f"prompt_chunk={self.prompt_chunk}: must be >= 1 token")
        needed = needs_draft_slot(self.spec.mode)
        if needed and self.draft is None:
            raise ValueError(f"spec mode {self.spec.mode!r} needs {needed}: set draft.model_path")
        history, learned = expand_path(self.suffix.history_path), expand_path(self.lookup.dynamic_path)
        if history and learned and os.path.realpath(history) == os.path.realpath(learned):
            raise ValueError(f"suffix.history_path and lookup.dynamic_path are the same file {history!r}: "
                             "each needs its own")


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
