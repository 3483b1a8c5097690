"""The node's parameters: one table, and the pure functions that read it.

Every parameter is declared from :data:`PARAMETERS` (name, default, description, range), so the
descriptors ``ros2 param describe`` shows, the defaults and ``docs/parameters.md`` cannot drift apart
(``python -m gemma_spec_ros.node.parameters --write docs/parameters.md`` regenerates the doc; a test
checks it is in sync).

Two kinds of parameter:

- **configure-time** (``backend``, ``remote.*``, ``target.*``, ``draft.*``, ``lookup.*``, ``suffix.*``,
  ``chat.*``, ``queue.max_running``): read
  by the configure transition to load the models (or reach the inference server). They are *not*
  ``read_only``: an operator fixing a wrong model path expects
  ``ros2 param set`` to work while the node is unconfigured. The node's set-parameters callback
  refuses to change them in any other state, with a reason ("cleanup first"), because the loaded
  models would no longer match the parameters.
- **runtime** (``spec.*``, ``generation.*``, ``limits.*``, ``queue.*``, ``feedback.*``,
  ``diagnostics.*``): validated by the callback and used from the next speculative step / the next
  goal; ``spec.*`` never reloads the target.

Defaults come from the engine's own config dataclasses where they exist, so there is one source.
ROS message types are imported only when a descriptor is built, so the table and the mapping to an
EngineConfig also serve tools that run where ROS is not installed (the bench on a GPU machine).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from ..engine.grammar.matcher import MAX_GRAMMAR_BYTES, compiled_constraint
from ..engine.modes import SPEC_MODES
from ..engine.config import (MAX_RUNNING, VERIFICATIONS, ChatConfig, EngineConfig, LookupConfig, ModelConfig,
                             SamplingParams, SpecConfig, SuffixConfig, expand_path)
from ..engine.remote.config import RemoteConfig

ParamValue = Union[str, int, float, bool]

#: Where scripts/setup.sh assembles the embedded default model (Gemma 3 270M Q4_K_M from PyPI).
EMBEDDED_MODEL_PATH = "~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf"
#: The folder the node's learned n-gram cache must lie in, by default (``lookup.cache_dir``).
CACHE_DIR = "~/.cache/gemma_spec_ros"
#: Prefixes of the parameters that only change while the node is unconfigured.
CONFIGURE_TIME_PREFIXES: Tuple[str, ...] = (
    "target.", "draft.", "lookup.", "suffix.", "backend", "remote.", "chat.", "queue.max_running",
    "traffic.")
#: Where generation runs: this process (llama.cpp in-process) or an OpenAI-compatible server.
BACKENDS: Tuple[str, ...] = ("local", "remote")
#: What serves when the remote server is unreachable.
FALLBACKS: Tuple[str, ...] = ("none", "local")
#: The draft's flash attention: the target's setting, or one of its own.
DRAFT_FLASH_ATTN: Tuple[str, ...] = ("target", "enabled", "disabled")
_INT_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

_MODEL = ModelConfig(path=EMBEDDED_MODEL_PATH)
_SPEC = SpecConfig()
_LOOKUP = LookupConfig()
_SUFFIX = SuffixConfig()
_SAMPLING = SamplingParams()
_CHAT = ChatConfig()
_REMOTE = RemoteConfig(url="http://127.0.0.1:8080")


@dataclass(frozen=True)
class ParamSpec:
    """One row of the parameter table. ``value_range`` is inclusive ``(low, high)``."""

    name: str
    default: ParamValue
    description: str
    value_range: Optional[Tuple[float, float]] = None
    choices: Tuple[str, ...] = ()  # allowed strings (checked by the set-parameters callback)
    #: The choice an unquoted YAML ``off``/``no``/``false`` stands for. The ROS parameter parser
    #: reads YAML 1.1, so ``ros2 param set /n p off``, ``-p p:=off`` and ``p: off`` in a file all
    #: send the boolean false; a parameter with this set also accepts that boolean (as this value).
    yaml_false: str = ""
    #: set at launch only (a parameter file or ``-p``): no peer can change it on a running node
    read_only: bool = False

    @property
    def configure_time(self) -> bool:
        """True if the parameter is only read by the configure transition."""
        return self.name.startswith(CONFIGURE_TIME_PREFIXES)

    @property
    def type_name(self) -> str:
        return type(self.default).__name__

    def descriptor(self):
        """The ``ParameterDescriptor`` rclpy enforces (type, range) and ``ros2 param describe`` shows."""
        from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                        ParameterType)
        ros_type = {str: ParameterType.PARAMETER_STRING, int: ParameterType.PARAMETER_INTEGER,
                    float: ParameterType.PARAMETER_DOUBLE, bool: ParameterType.PARAMETER_BOOL}
        descriptor = ParameterDescriptor(
            name=self.name, type=ros_type[type(self.default)], description=self.description,
            additional_constraints=self.constraints, read_only=self.read_only,
            # a string that must also take YAML's boolean false: rclpy checks no type then, and
            # the set-parameters callback (check_choices) refuses anything but a choice or false
            dynamic_typing=bool(self.yaml_false))
        if self.value_range is not None:
            low, high = self.value_range
            if isinstance(self.default, float):
                descriptor.floating_point_range = [
                    FloatingPointRange(from_value=float(low), to_value=float(high), step=0.0)]
            else:
                descriptor.integer_range = [IntegerRange(from_value=int(low), to_value=int(high), step=1)]
        return descriptor

    @property
    def constraints(self) -> str:
        """Human-readable constraints beyond the type and range."""
        parts = []
        if self.choices:
            parts.append("one of: " + ", ".join(self.choices))
        if self.yaml_false:
            parts.append(f"unquoted YAML {self.yaml_false} (boolean false) means {self.yaml_false}")
        if self.read_only:
            parts.append("read-only: set at launch only")
        elif self.configure_time:
            parts.append("configure-time: set only while unconfigured")
        return "; ".join(parts)


def _model_rows(prefix: str, what: str, path_default: str, path_help: str,
                with_batch: bool) -> Tuple[ParamSpec, ...]:
    """The rows shared by ``target.*`` and ``draft.*``."""
    rows = [
        ParamSpec(f"{prefix}.model_path", path_default, path_help),
        ParamSpec(f"{prefix}.n_gpu_layers", _MODEL.n_gpu_layers,
                  f"{what} layers offloaded to the GPU; -1 = all", (-1, 10_000)),
        ParamSpec(f"{prefix}.n_ctx", _MODEL.n_ctx if with_batch else 0,
                  f"{what} context length in tokens (prompt + generation)"
                  + ("" if with_batch else "; 0 = target.n_ctx"),
                  (16 if with_batch else 0, 1 << 20)),
        ParamSpec(f"{prefix}.n_threads", _MODEL.n_threads,
                  f"CPU threads for the {what}; 0 = all cores", (0, 1024)),
    ]
    if with_batch:
        rows += [
            ParamSpec(f"{prefix}.n_batch", _MODEL.n_batch,
                      "largest batch one llama_decode call gets (prompt chunks)", (1, 1 << 16)),
            ParamSpec(f"{prefix}.flash_attn", _MODEL.flash_attn,
                      ("flash attention for the target, and for the draft unless draft.flash_attn says otherwise "
                       "(faster on GPUs and CPUs; logits then depend on the batch)")),
        ]
    else:
        rows.append(ParamSpec(f"{prefix}.flash_attn", "target",
                              "flash attention for the draft model, assistant or head: target = as target.flash_attn; "
                              "on a CPU a small model's one-row draft step can be faster without it",
                              choices=DRAFT_FLASH_ATTN))
    return tuple(rows)


#: The parameter table. Order = declaration order = order in docs/parameters.md.
PARAMETERS: Tuple[ParamSpec, ...] = (
    ParamSpec("backend", "local",
              "local: generate in this process (target.*, draft.*); remote: stream from the "
              "OpenAI-compatible server at remote.url (llama-server, vLLM, llama_cpp.server), which "
              "runs its own speculation", choices=BACKENDS),
    ParamSpec("remote.url", _REMOTE.url,
              "base URL of the inference server (http or https; a trailing /v1 is accepted)"),
    ParamSpec("remote.model", _REMOTE.model,
              "model name sent with each request; '' = the server's default model"),
    ParamSpec("remote.api_key_env", _REMOTE.api_key_env,
              "NAME of the environment variable holding the server's API key (sent as a Bearer "
              "token); '' = no key. The key itself is never a parameter"),
    ParamSpec("remote.connect_timeout", _REMOTE.connect_timeout,
              "seconds to connect to the server; also the limit of its tokenizer and probe calls",
              (0.01, 600.0)),
    ParamSpec("remote.read_timeout", _REMOTE.read_timeout,
              "seconds a stream may go without a data event (the first token included; keep-alive "
              "comments do not count) before the goal ends with an error", (0.01, 86400.0)),
    ParamSpec("remote.probe_period", _REMOTE.probe_period,
              "seconds between reachability/RTT probes (GET /health) and /metrics reads; 0 = off",
              (0.0, 3600.0)),
    ParamSpec("remote.n_ctx", _REMOTE.n_ctx,
              "context length for goal checks; 0 = what the server reports (llama-server /props, "
              "vLLM max_model_len), else the server alone checks", (0, 1 << 24)),
    ParamSpec("remote.fallback", "none",
              "local: generate with the local model (target.*) when the server is unreachable "
              "(the model is loaded at configure); none: such goals end with an error",
              choices=FALLBACKS),
    *_model_rows("target", "target", EMBEDDED_MODEL_PATH,
                 "target model .gguf ('~' and $VARS expanded)", with_batch=True),
    ParamSpec("target.prepare_grammar", False,
              "true: build the grammar engine's tokenizer of the target's vocabulary at configure "
              "(~2.6 s for Gemma's 262k tokens on a 2-core CPU, ~1.6 s of it holding Python's GIL); "
              "false: at the first constrained goal or chat turn, which then waits for it while the "
              "node's other callbacks stall"),
    *_model_rows("draft", "draft", "",
                 "draft model .gguf with the target's vocabulary, or a Gemma 4 MTP assistant "
                 "(a gemma4-assistant .gguf: spec.mode mtp), or an EAGLE-3 head (an eagle3 .gguf: "
                 "spec.mode eagle3); '' = no draft model",
                 with_batch=False),
    ParamSpec("spec.mode", _SPEC.mode, "speculative mode; applies from the next step, no reload",
              choices=SPEC_MODES, yaml_false="off"),
    ParamSpec("spec.draft_max", _SPEC.draft_max,
              "K: the most tokens drafted per step (the adaptive policy may use fewer)", (1, 64)),
    ParamSpec("spec.draft_min", _SPEC.draft_min,
              "a model draft shorter than this is dropped (0/1 = keep any); <= spec.draft_max",
              (0, 64)),
    ParamSpec("spec.p_min", _SPEC.p_min,
              "model drafting stops when the draft's top probability falls below this", (0.0, 1.0)),
    ParamSpec("spec.adaptive", _SPEC.adaptive,
              "adapt K to measured acceptance and cost; false = always spec.draft_max"),
    ParamSpec("spec.verification", _SPEC.verification,
              "exact: lossless for any drafter; rejection: min(1, p/q) for stochastic model drafts",
              choices=VERIFICATIONS),
    ParamSpec("lookup.static_path", _LOOKUP.static_path,
              "static n-gram cache (llama-lookup-create format); '' = none"),
    ParamSpec("lookup.dynamic_path", _LOOKUP.dynamic_path,
              "dynamic (learned) n-gram cache: loaded if present, saved at cleanup/shutdown; only a "
              "file this node wrote is read or replaced; inside lookup.cache_dir; '' = memory only"),
    ParamSpec("lookup.cache_dir", CACHE_DIR,
              "folder lookup.dynamic_path must lie in (the one file the node writes); '' = anywhere",
              read_only=True),
    ParamSpec("lookup.dynamic_max_ngrams", _LOOKUP.dynamic_max_ngrams,
              "the dynamic cache keeps at most this many n-grams (~0.4 KB each in memory); the "
              "least seen are evicted", (1, 100_000_000)),
    ParamSpec("lookup.save_period", _LOOKUP.save_period,
              "seconds between atomic saves of the dynamic cache while serving; 0 = only at "
              "cleanup/shutdown", (0.0, 86_400.0)),
    ParamSpec("lookup.ngram_min", _LOOKUP.ngram_min, "shortest context n-gram tried", (1, 4)),
    ParamSpec("lookup.ngram_max", _LOOKUP.ngram_max,
              "longest context n-gram tried; >= lookup.ngram_min", (1, 4)),
    ParamSpec("suffix.history_path", _SUFFIX.history_path,
              "the suffix drafter's history of earlier outputs (spec.mode suffix, suffix+lookup): loaded "
              "if present, saved at cleanup/shutdown; only a file this node wrote for this vocabulary is "
              "read or replaced; a file name lies in lookup.cache_dir, an absolute path must too; not "
              "lookup.dynamic_path; '' = memory only"),
    ParamSpec("suffix.history_max_tokens", _SUFFIX.history_max_tokens,
              "tokens of earlier outputs the suffix history keeps (~0.35 KB each in memory); the "
              "oldest are evicted first; 0 = none (the request's own tokens only)", (0, 1 << 20)),
    ParamSpec("suffix.save_period", _SUFFIX.save_period,
              "seconds between atomic saves of the suffix history while serving; 0 = only at "
              "cleanup/shutdown", (0.0, 86_400.0)),
    ParamSpec("chat.template_path", _CHAT.template_path,
              "Jinja chat template file for ~/generate_chat turns instead of the model's own "
              "(tokenizer.chat_template), e.g. for a base model without one: a regular file of at most "
              "256 KiB that renders `messages`; '' = the model's own"),
    ParamSpec("chat.conversation_cache_mb", _CHAT.conversation_cache_bytes >> 20,
              "host memory (MiB) for recent conversations' KV: a follow-up turn after another "
              "conversation's evaluates only its new tokens; least recently used out first; 0 = none",
              (0, 1 << 12)),
    ParamSpec("traffic.log_path", "",
              "request log, training data for a draft head (gemma-spec-export-traffic): each finished "
              "goal's prompt or conversation and the target's reply, appended as JSON Lines; holds the "
              "clients' prompts in plain text; a file name lies in lookup.cache_dir, an absolute path "
              "must too; only a file this node wrote as its log is appended to or rotated; '' = off"),
    ParamSpec("traffic.max_bytes", 64 << 20,
              "bytes the request log and its one rotated file (the same name + .1) hold together; "
              "the oldest records go first", (1 << 20, 1 << 30)),
    ParamSpec("generation.max_tokens", 128,
              "tokens generated when a goal's max_tokens is 0; <= limits.max_tokens", (1, 1 << 20)),
    ParamSpec("generation.temperature", _SAMPLING.temperature,
              "temperature of goals that send temperature -1 (0 = greedy; a goal's 0 is greedy too)",
              (0.0, 100.0)),
    ParamSpec("generation.top_p", _SAMPLING.top_p,
              "nucleus mass used when a goal's top_p is 0; in (0, 1]", (0.0, 1.0)),
    ParamSpec("generation.top_k", _SAMPLING.top_k,
              "top-k of goals that send top_k -1 (0 = no limit; a goal's 0 is no limit too)",
              (0, _INT_MAX)),
    ParamSpec("generation.seed", _SAMPLING.seed,
              "sampler seed used when a goal's seed is -1; -1 = random", (-1, _INT64_MAX)),
    ParamSpec("generation.time_budget", 0.0,
              "seconds from acceptance after which a goal that sends time_budget 0 ends with "
              "finish_reason timeout and its text so far; 0 = no limit", (0.0, 86_400.0)),
    ParamSpec("generation.grammar", "",
              "GBNF grammar (llama.cpp's format, rule root) for goals that set neither grammar nor "
              "json_schema; '' = unconstrained"),
    ParamSpec("generation.json_schema", "",
              "JSON Schema (text) for goals that set neither grammar nor json_schema; at most one of "
              "generation.grammar and generation.json_schema"),
    ParamSpec("generation.prompt_cache", True,
              "reuse the KV cache of the previous request's common prompt prefix (a planner's "
              "repeated system prompt is evaluated once); false = evaluate every prompt whole, "
              "for output independent of earlier requests with quantized weights"),
    ParamSpec("limits.max_prompt_tokens", 1536,
              "goals whose (templated) prompt has more tokens are rejected", (1, 1 << 20)),
    ParamSpec("limits.max_tokens", 1024,
              "goals asking for more tokens are rejected", (1, 1 << 20)),
    ParamSpec("limits.max_prompt_bytes", 1 << 16,
              "goals whose prompt + system prompt exceed this many UTF-8 bytes are rejected before "
              "tokenizing", (1, 1 << 26)),
    ParamSpec("limits.max_stop_strings", 16, "goals with more stop strings are rejected", (0, 1024)),
    ParamSpec("limits.max_stop_length", 128,
              "goals with a longer stop string (characters) are rejected", (1, 1 << 16)),
    ParamSpec("limits.max_grammar_bytes", 1 << 16,
              "goals with a longer grammar or json_schema (UTF-8 bytes) are rejected", (0, MAX_GRAMMAR_BYTES)),
    ParamSpec("queue.result_timeout", 60.0,
              "seconds a finished goal's result (and its request) is kept for late get_result "
              "calls; read by configure", (1.0, 86_400.0)),
    ParamSpec("queue.max_depth", 4,
              "accepted goals that may wait behind the running ones; more are rejected", (0, 1000)),
    ParamSpec("queue.max_running", 1,
              "goals served at once, their steps decoded in one pass (each a sequence of the target's "
              "KV cache: that much more memory); 1 = one at a time. Not with an MTP assistant or "
              "EAGLE-3 head; where a pass over that many rows costs as much as that many one-row "
              "passes the node serves one at a time and says so on /diagnostics; read by configure",
              (1, MAX_RUNNING)),
    ParamSpec("feedback.min_period", 0.0,
              "seconds between two feedback messages of a goal (text in between is kept); 0 = every "
              "step", (0.0, 60.0)),
    ParamSpec("diagnostics.period", 1.0, "seconds between /diagnostics and rolling stats messages",
              (0.05, 3600.0)),
    ParamSpec("diagnostics.hardware_id", "", "hardware_id of the diagnostic status; '' = host name"),
)

PARAMETERS_BY_NAME: Dict[str, ParamSpec] = {p.name: p for p in PARAMETERS}
_YAML_FALSE: Dict[str, str] = {p.name: p.yaml_false for p in PARAMETERS if p.yaml_false}


def defaults() -> Dict[str, ParamValue]:
    """Every parameter's default value, by name."""
    return {p.name: p.default for p in PARAMETERS}


def as_declared(values: Mapping[str, Any]) -> Dict[str, Any]:
    """``values`` as the table declares them: YAML's boolean false -> the row's ``yaml_false`` choice.

    The one place YAML's ``off`` quirk is undone, where values enter: the node's parameters and
    their changes, a parameters file a tool reads. Everything after trusts them.

    >>> as_declared({"spec.mode": False, "spec.adaptive": False, "backend": "local"})
    {'spec.mode': 'off', 'spec.adaptive': False, 'backend': 'local'}
    """
    return {name: _YAML_FALSE.get(name, value) if value is False else value
            for name, value in values.items()}


def check_choices(values: Mapping[str, Any]) -> str:
    """'' if every string parameter in ``values`` is one of its choices, else the reason.

    Expects :func:`as_declared` values (an unquoted ``off`` already the string).

    >>> check_choices({"spec.mode": "off"}), check_choices({"spec.mode": True})[:38]
    ('', 'spec.mode=True: YAML read an unquoted ')
    """
    for name, value in values.items():
        spec = PARAMETERS_BY_NAME.get(name)
        if spec is None or not spec.choices:
            continue
        if isinstance(value, bool):
            return (f"{name}={value}: YAML read an unquoted on/yes/true as a boolean; "
                    f"expected one of {', '.join(spec.choices)}")
        if value not in spec.choices:
            return f"{name}={value!r}: expected one of {', '.join(spec.choices)}"
    return ""


def spec_config_from(values: Mapping[str, Any]) -> SpecConfig:
    """``spec.*`` parameters -> SpecConfig; raises ValueError with a user-facing reason."""
    return SpecConfig(mode=values["spec.mode"],
                      draft_max=values["spec.draft_max"],
                      draft_min=values["spec.draft_min"], p_min=values["spec.p_min"],
                      adaptive=values["spec.adaptive"], verification=values["spec.verification"])


def sampling_from(values: Mapping[str, Any]) -> SamplingParams:
    """``generation.*`` defaults -> SamplingParams; raises ValueError with a user-facing reason."""
    return SamplingParams(temperature=values["generation.temperature"],
                          top_k=values["generation.top_k"], top_p=values["generation.top_p"],
                          seed=values["generation.seed"])


def engine_config_from(values: Mapping[str, Any]) -> EngineConfig:
    """All parameters -> EngineConfig; raises ValueError with a user-facing reason.

    The draft model shares the target's ``n_batch``, and its ``flash_attn`` unless
    ``draft.flash_attn`` says otherwise; ``draft.n_ctx`` 0 means the target's context length.
    """
    target = ModelConfig(path=values["target.model_path"], n_gpu_layers=values["target.n_gpu_layers"],
                         n_ctx=values["target.n_ctx"], n_batch=values["target.n_batch"],
                         n_threads=values["target.n_threads"], flash_attn=values["target.flash_attn"])
    draft = None
    if values["draft.model_path"]:
        draft = replace(target, path=values["draft.model_path"],
                        n_gpu_layers=values["draft.n_gpu_layers"],
                        n_ctx=values["draft.n_ctx"] or target.n_ctx,
                        n_threads=values["draft.n_threads"],
                        flash_attn=(target.flash_attn if values["draft.flash_attn"] == "target"
                                    else values["draft.flash_attn"] == "enabled"))
    lookup = LookupConfig(static_path=values["lookup.static_path"],
                          dynamic_path=values["lookup.dynamic_path"],
                          cache_dir=values["lookup.cache_dir"],
                          ngram_min=values["lookup.ngram_min"], ngram_max=values["lookup.ngram_max"],
                          dynamic_max_ngrams=values["lookup.dynamic_max_ngrams"],
                          save_period=values["lookup.save_period"])
    suffix = SuffixConfig(history_path=history_path(values["suffix.history_path"], values["lookup.cache_dir"]),
                          cache_dir=values["lookup.cache_dir"],
                          history_max_tokens=values["suffix.history_max_tokens"],
                          save_period=values["suffix.save_period"])
    chat = ChatConfig(template_path=values["chat.template_path"],
                      conversation_cache_bytes=values["chat.conversation_cache_mb"] << 20)
    return EngineConfig(target=target, draft=draft, spec=spec_config_from(values), lookup=lookup,
                        suffix=suffix, chat=chat, max_running=values["queue.max_running"],
                        prepare_grammar=values["target.prepare_grammar"])


def history_path(path: str, cache_dir: str) -> str:
    """``suffix.history_path`` as a path: a relative one (a file name, as the shipped profiles give)
    lies in ``lookup.cache_dir``, so the history follows the folder the node owns; ValueError if
    there is no such folder to put it in.

    >>> history_path("suffix-history.bin", "~/.cache/gemma_spec_ros"), history_path("", "/c")
    ('~/.cache/gemma_spec_ros/suffix-history.bin', '')
    """
    if not path or os.path.isabs(expand_path(path)):
        return path
    if not cache_dir:
        raise ValueError(f"suffix.history_path {path!r} is relative to lookup.cache_dir, which is '': "
                         "give an absolute path")
    return os.path.join(cache_dir, path)


def remote_config_from(values: Mapping[str, Any]) -> RemoteConfig:
    """``remote.*`` parameters -> RemoteConfig; raises ValueError with a user-facing reason."""
    return RemoteConfig(url=values["remote.url"], model=values["remote.model"],
                        api_key_env=values["remote.api_key_env"],
                        connect_timeout=values["remote.connect_timeout"],
                        read_timeout=values["remote.read_timeout"],
                        probe_period=values["remote.probe_period"], n_ctx=values["remote.n_ctx"],
                        max_prompt_tokens=values["limits.max_prompt_tokens"])


def check_values(values: Mapping[str, Any], configured: bool) -> str:
    """'' if a full set of parameter values is consistent, else the reason.

    Checks what the descriptors' ranges cannot: choices, cross-parameter rules and, while the node is
    unconfigured, the whole engine config (a configured node already holds a valid one and refuses
    configure-time changes).
    """
    reason = check_choices(values)
    if reason:
        return reason
    if values["generation.max_tokens"] > values["limits.max_tokens"]:
        return (f"generation.max_tokens={values['generation.max_tokens']} exceeds "
                f"limits.max_tokens={values['limits.max_tokens']}")
    try:
        sampling_from(values)
        # the default constraint, checked as a goal's is (parse and compile; cached by text)
        compiled_constraint(values["generation.grammar"], values["generation.json_schema"],
                            values["limits.max_grammar_bytes"])
        if configured:
            spec_config_from(values)
        else:
            engine_config_from(values)
            if values["backend"] == "remote":
                remote_config_from(values)
    except ValueError as exc:
        return str(exc)
    return ""


def render_markdown() -> str:
    """docs/parameters.md, generated from :data:`PARAMETERS`."""
    lines = [
        "# Parameters of the `gemma_spec` node",
        "",
        "Generated from `gemma_spec_ros/node/parameters.py` by",
        "`python -m gemma_spec_ros.node.parameters --write docs/parameters.md`; do not edit by hand.",
        "",
        "Configure-time parameters (`backend`, `remote.*`, `target.*`, `draft.*`, `lookup.*`, `suffix.*`,",
        "`chat.*`) are read",
        "by the configure transition. They can be set (`ros2 param set`) only while the node is",
        "unconfigured: in any other state the node refuses the change with a reason, since the loaded",
        "models would no longer match.",
        "Runtime parameters are validated when set and apply from the next speculative step (`spec.*`,",
        "no reload of the target) or the next goal.",
        "",
        "With `backend: remote` the server runs the speculation: `spec.*` changes and a goal's",
        "`spec_mode` are refused with the reason. A goal's prompt is checked against",
        "`limits.max_prompt_tokens` and the server's context on a lower-bound estimate (one token per",
        "16 UTF-8 bytes, +16 for a chat template), with no call to the server (the goal callback also",
        "serves cancels): only prompts that cannot fit are refused there. When the goal starts, the",
        "server's tokenizer counts it exactly (llama-server `/tokenize`, vLLM `/tokenize`,",
        "llama_cpp.server `/extras/tokenize/count`), and a prompt over `limits.max_prompt_tokens` (as",
        "of configure) or the context ends the goal with an error; `/diagnostics` says what counted",
        "(`prompt tokens by`). See docs/deployment.md.",
        "",
        "| name | type | default | range | description |",
        "|---|---|---|---|---|",
    ]
    for p in PARAMETERS:
        low_high = "" if p.value_range is None else f"[{_fmt(p.value_range[0])}, {_fmt(p.value_range[1])}]"
        extra = f" ({p.constraints})" if p.constraints else ""
        lines.append(f"| `{p.name}` | {p.type_name} | `{_fmt(p.default)}` | {low_high} | "
                     f"{p.description}{extra} |")
    return "\n".join(lines) + "\n"


def _fmt(value: ParamValue) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if not value else value
    if isinstance(value, float) and value.is_integer():
        return f"{value:.1f}"
    return str(value)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print docs/parameters.md, or write it with ``--write PATH``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", metavar="PATH", help="write the table to PATH")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
