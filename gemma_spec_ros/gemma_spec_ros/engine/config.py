"""The engine's configuration: frozen dataclasses validated in ``__post_init__``.

Every check raises ``ValueError`` with a message a user can act on. Nothing here imports
llama_cpp, so the node can validate input without a model.

A field an operator sets carries what it is as metadata (:func:`param`: its description, range
and choices): the validation here (:func:`check_params`), the node's parameter table and
docs/parameters.md (node/parameters.py ``rows_of``) and the building of a config from parameter
values (``config_of``) all read it, so a new setting is one field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Tuple

from .modes import SPEC_MODES, check_mode_name, needs_draft_slot


#: Verification rules. ``exact``: accept while the target's own sample equals the draft (lossless
#: for any drafter). ``rejection``: Leviathan/Chen min(1, p/q) with residual resampling.
VERIFICATIONS: Tuple[str, ...] = ("exact", "rejection")
#: The most requests one engine serves at once (slots): each adds up to 65 rows to a pass.
MAX_RUNNING = 4
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Param:
    """What a config field is to an operator: one node parameter (``<group>.<name>``).

    ``name``: the parameter's name in its group ('' = the field's); ``scale``: the field holds the
    parameter's value times this (``chat.conversation_cache_mb`` -> bytes); ``node`` False: a field
    the code sets, not a parameter (its range is still checked); ``yaml_false``: the choice an
    unquoted YAML ``off``/``no``/``false`` stands for (node/parameters.py); ``read_only``: set at
    launch only."""

    description: str
    range: Optional[Tuple[float, float]] = None  # inclusive (low, high), in the parameter's unit
    choices: Tuple[str, ...] = ()
    name: str = ""
    scale: int = 1
    node: bool = True
    yaml_false: str = ""
    read_only: bool = False


def param(default: Any, description: str, range: Optional[Tuple[float, float]] = None,  # noqa: A002
          choices: Tuple[str, ...] = (), **more: Any) -> Any:
    """A dataclass field with its :class:`Param` metadata (``choices`` kept as given when it is a
    sequence other than a list: the mode names' live view, modes.SPEC_MODES)."""
    kept = tuple(choices) if isinstance(choices, list) else choices
    return field(default=default, metadata={"param": Param(description, range, kept, **more)})


def params_of(config_type: type) -> Tuple[Tuple[str, Param], ...]:
    """(field name, Param) of a config dataclass's fields that carry one, in field order."""
    return tuple((f.name, f.metadata["param"]) for f in fields(config_type) if "param" in f.metadata)


def check_params(config: Any) -> None:
    """ValueError for a field outside its range or choices (:class:`Param`), named as the field.

    >>> SpecConfig(draft_max=99)
    Traceback (most recent call last):
    ...
    ValueError: draft_max=99: must be in [1, 64]
    """
    for name, meta in params_of(type(config)):
        value = getattr(config, name)
        if meta.choices and value not in meta.choices:
            raise ValueError(f"{name} {value!r}: expected one of {', '.join(meta.choices)}")
        if meta.range is not None and not isinstance(value, (bool, str)):
            low, high = (bound * meta.scale for bound in meta.range)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
                shown = value if meta.scale == 1 else value / meta.scale
                raise ValueError(f"{meta.name or name}={shown}: must be in [{_number(meta.range[0])}, "
                                 f"{_number(meta.range[1])}]")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def expand_path(path: str) -> str:
    """``~`` and ``$VARS`` expanded; empty stays empty."""
    return os.path.expandvars(os.path.expanduser(path)) if path else ""


@dataclass(frozen=True)
class ModelConfig:
    """One GGUF model as llama.cpp loads it (node parameters ``target.*``; ``draft.*`` are written
    in node/parameters.py, since a draft shares some of the target's)."""

    path: str = param("", "model .gguf ('~' and $VARS expanded)", name="model_path")
    n_gpu_layers: int = param(0, "layers offloaded to the GPU; -1 = all", (-1, 10_000))
    n_ctx: int = param(2048, "context length in tokens (prompt + generation)", (16, 1 << 20))
    n_batch: int = param(512, "largest batch one llama_decode call gets (prompt chunks)", (1, 1 << 16))
    n_threads: int = param(0, "CPU threads; 0 = all cores", (0, 1024))
    flash_attn: bool = param(False, "flash attention (faster on GPUs and CPUs; logits then depend on the batch)")
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
        check_params(self)

    @property
    def resolved_path(self) -> str:
        return expand_path(self.path)


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs. ``mode`` and ``draft_max`` may change while the engine runs."""

    mode: str = param("lookup", "speculative mode; applies from the next step, no reload",
                      choices=SPEC_MODES, yaml_false="off")
    draft_max: int = param(8, "K: the most tokens drafted per step (the adaptive policy may use fewer)", (1, 64))
    draft_min: int = param(0, "a model draft shorter than this is dropped (0/1 = keep any); <= spec.draft_max",
                           (0, 64))
    p_min: float = param(0.75, "model drafting stops when the draft's top probability falls below this",
                         (0.0, 1.0))
    adaptive: bool = param(True, "adapt K to measured acceptance and cost; false = always spec.draft_max")
    verification: str = param("exact", "exact: lossless for any drafter; rejection: min(1, p/q) for stochastic "
                              "model drafts", choices=VERIFICATIONS)

    def __post_init__(self) -> None:
        check_mode_name(self.mode)
        check_params(self)
        if self.draft_min > self.draft_max:
            raise ValueError(f"draft_min={self.draft_min}: must be in [0, draft_max={self.draft_max}]")


@dataclass(frozen=True)
class LookupConfig:
    """The n-gram lookahead caches (llama.cpp's lookup decoding)."""

    static_path: str = param("", "static n-gram cache (llama-lookup-create format); '' = none")
    dynamic_path: str = param("", "dynamic (learned) n-gram cache: loaded if present, saved at cleanup/shutdown; "
                              "only a file this node wrote is read or replaced; inside lookup.cache_dir; "
                              "'' = memory only")
    #: if set, ``dynamic_path`` must lie inside this folder (after resolving links): the learned
    #: cache is the one file the engine writes, so a path set by a peer cannot create files elsewhere
    cache_dir: str = param("", "folder lookup.dynamic_path must lie in (the one file the node writes); "
                           "'' = anywhere", read_only=True)
    #: the dynamic cache keeps at most this many n-grams (~0.4 KB each in memory): past it, the
    #: n-grams seen least often (the oldest among equals) are evicted, down to 90 % of it
    dynamic_max_ngrams: int = param(100_000, "the dynamic cache keeps at most this many n-grams (~0.4 KB each "
                                    "in memory); the least seen are evicted", (1, 100_000_000))
    save_period: float = param(300.0, "seconds between atomic saves of the dynamic cache while serving; 0 = "
                               "only at cleanup/shutdown", (0.0, 86_400.0))
    ngram_min: int = param(1, "shortest context n-gram tried", (1, 4))
    ngram_max: int = param(4, "longest context n-gram tried (llama.cpp's cache format allows <= 4); "
                           ">= lookup.ngram_min", (1, 4))

    def __post_init__(self) -> None:
        if self.dynamic_max_ngrams < 1:
            raise ValueError(f"dynamic_max_ngrams={self.dynamic_max_ngrams}: must be >= 1")
        if not math.isfinite(self.save_period) or self.save_period < 0:
            raise ValueError(f"save_period={self.save_period}: must be >= 0 seconds (0 = on close)")
        check_params(self)
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
    #: (its node parameter is relative to lookup.cache_dir: node/parameters.py writes it)
    history_path: str = ""
    #: if set, ``history_path`` must lie inside this folder (the learned cache's, lookup.cache_dir)
    cache_dir: str = ""
    #: tokens of earlier outputs kept, the oldest evicted first (at 65,536: 22 MiB, a propose
    #: ~0.1 ms, loading the file 0.7 s)
    history_max_tokens: int = param(65_536, "tokens of earlier outputs the suffix history keeps (~0.35 KB each "
                                    "in memory); the oldest are evicted first; 0 = none (the request's own "
                                    "tokens only)", (0, 1 << 20))
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
    save_period: float = param(300.0, "seconds between atomic saves of the suffix history while serving; 0 = "
                               "only at cleanup/shutdown", (0.0, 86_400.0))

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
        check_params(self)
        if self.cache_dir and self.history_path:
            folder = os.path.realpath(expand_path(self.cache_dir))
            target = os.path.realpath(expand_path(self.history_path))
            if os.path.commonpath([folder, target]) != folder:
                raise ValueError(
                    f"suffix.history_path {self.history_path!r} is outside the cache folder "
                    f"{self.cache_dir!r}: the node writes only there")


@dataclass(frozen=True)
class ChatConfig:
    """Chat turns (engine/chat/): the template that renders them, and the conversations' KV kept
    between turns (engine/conversations.py)."""

    template_path: str = param("", "Jinja chat template file for ~/generate_chat turns instead of the model's "
                               "own (tokenizer.chat_template), e.g. for a base model without one: a regular "
                               "file of at most 256 KiB that renders `messages`; '' = the model's own")
    conversation_cache_bytes: int = param(256 << 20, "host memory (MiB) for recent conversations' KV: a "
                                          "follow-up turn after another conversation's evaluates only its new "
                                          "tokens; least recently used out first; 0 = none", (0, 1 << 12),
                                          name="conversation_cache_mb", scale=1 << 20)

    def __post_init__(self) -> None:
        if self.conversation_cache_bytes < 0:
            raise ValueError(f"conversation_cache_bytes={self.conversation_cache_bytes}: must be >= 0 "
                             "(0 = keep no conversation's KV)")
        check_params(self)


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

    temperature: float = param(0.0, "temperature of goals that send temperature -1 (0 = greedy; a goal's 0 is "
                               "greedy too)", (0.0, 100.0))
    top_k: int = param(0, "top-k of goals that send top_k -1 (0 = no limit; a goal's 0 is no limit too)",
                       (0, INT32_MAX))
    top_p: float = param(1.0, "nucleus mass used when a goal's top_p is 0; in (0, 1]", (0.0, 1.0))
    min_p: float = 0.0  # in [0, 1): drop tokens below min_p * p(top token)
    seed: int = param(-1, "sampler seed used when a goal's seed is -1 (a goal's own seed otherwise); -1 = a "
                      "random seed for each goal", (-1, INT64_MAX))

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be finite and >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = no limit)")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1)")
        check_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
