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
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from ..engine.grammar.matcher import MAX_GRAMMAR_BYTES, compiled_constraint
from ..engine.config import (MAX_RUNNING, ChatConfig, EngineConfig, LookupConfig, ModelConfig, SamplingParams,
                             SpecConfig, SuffixConfig, check_params, expand_path, param, params_of)
from ..engine.remote.config import RemoteConfig

ParamValue = Union[str, int, float, bool]

#: Where scripts/setup.sh assembles the embedded default model (Gemma 3 270M Q4_K_M from PyPI).
EMBEDDED_MODEL_PATH = "~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf"
#: The folder the node's learned n-gram cache must lie in, by default (``lookup.cache_dir``).
CACHE_DIR = "~/.cache/gemma_spec_ros"
#: Prefixes of the parameters that only change while the node is unconfigured.
CONFIGURE_TIME_PREFIXES: Tuple[str, ...] = (
    "backend", "remote.", "target.", "draft.", "lookup.", "suffix.", "chat.", "traffic.", "queue.max_running",
    "queue.result_timeout")
#: Where generation runs: this process (llama.cpp in-process) or an OpenAI-compatible server.
BACKENDS: Tuple[str, ...] = ("local", "remote")
#: What serves when the remote server is unreachable.
FALLBACKS: Tuple[str, ...] = ("none", "local")
#: The draft's flash attention: the target's setting, or one of its own.
DRAFT_FLASH_ATTN: Tuple[str, ...] = ("target", "enabled", "disabled")
_SUFFIX = SuffixConfig()


# -- the node's own groups: settings only the node reads (the engine's are its config dataclasses) --
@dataclass(frozen=True)
class GenerationDefaults:
    """``generation.*`` besides the sampler's (SamplingParams): what a goal that leaves a field at
    its "use the default" value gets."""

    max_tokens: int = param(128, "tokens generated when a goal's max_tokens is 0; <= limits.max_tokens",
                            (1, 1 << 20))
    time_budget: float = param(0.0, "seconds from acceptance after which a goal that sends time_budget 0 ends "
                               "with finish_reason timeout and its text so far; 0 = no limit", (0.0, 86_400.0))
    grammar: str = param("", "GBNF grammar (llama.cpp's format, rule root) for goals that set neither grammar "
                         "nor json_schema; '' = unconstrained")
    json_schema: str = param("", "JSON Schema (text) for goals that set neither grammar nor json_schema; at "
                             "most one of generation.grammar and generation.json_schema")
    prompt_cache: bool = param(True, "reuse the KV cache of the previous request's common prompt prefix (a "
                               "planner's repeated system prompt is evaluated once); false = evaluate every "
                               "prompt whole, for output independent of earlier requests with quantized weights")

    def __post_init__(self) -> None:
        check_params(self)


@dataclass(frozen=True)
class Limits:
    """``limits.*``: what one goal may ask, checked in the goal callback."""

    max_prompt_tokens: int = param(1536, "goals whose (templated) prompt has more tokens are rejected",
                                   (1, 1 << 20))
    max_tokens: int = param(1024, "goals asking for more tokens are rejected", (1, 1 << 20))
    max_prompt_bytes: int = param(1 << 16, "goals whose prompt + system prompt exceed this many UTF-8 bytes are "
                                  "rejected before tokenizing", (1, 1 << 26))
    max_stop_strings: int = param(16, "goals with more stop strings are rejected", (0, 1024))
    max_stop_length: int = param(128, "goals with a longer stop string (characters) are rejected", (1, 1 << 16))
    max_grammar_bytes: int = param(1 << 16, "goals with a longer grammar or json_schema (UTF-8 bytes) are "
                                   "rejected", (0, MAX_GRAMMAR_BYTES))

    def __post_init__(self) -> None:
        check_params(self)


@dataclass(frozen=True)
class QueueSettings:
    """``queue.*``: how goals wait and run."""

    result_timeout: float = param(60.0, "seconds a finished goal's result (and its request) is kept for late "
                                  "get_result calls", (1.0, 86_400.0))
    max_depth: int = param(4, "accepted goals that may wait behind the running ones; more are rejected",
                           (0, 1000))
    max_running: int = param(1, "goals served at once, their steps decoded in one pass (each a sequence of the "
                             "target's KV cache: that much more memory); 1 = one at a time. Not with an MTP "
                             "assistant or EAGLE-3 head; where a pass over that many rows costs as much as that "
                             "many one-row passes the node serves one at a time and says so on /diagnostics",
                             (1, MAX_RUNNING))


@dataclass(frozen=True)
class TrafficSettings:
    """``traffic.*``: the request log (engine/request_log.py), off by default."""

    log_path: str = param("", "request log, training data for a draft head (gemma-spec-export-traffic): each "
                          "finished goal's prompt or conversation and the target's reply, appended as JSON Lines; "
                          "holds the clients' prompts in plain text; a file name lies in lookup.cache_dir, an "
                          "absolute path must too; only a file this node wrote as its log is appended to or "
                          "rotated; '' = off")
    max_bytes: int = param(64 << 20, "bytes the request log and its one rotated file (the same name + .1) hold "
                           "together; the oldest records go first", (1 << 20, 1 << 30))


@dataclass(frozen=True)
class FeedbackSettings:
    min_period: float = param(0.0, "seconds between two feedback messages of a goal (text in between is kept); "
                              "0 = every step", (0.0, 60.0))


@dataclass(frozen=True)
class DiagnosticsSettings:
    period: float = param(1.0, "seconds between /diagnostics and rolling stats messages", (0.05, 3600.0))
    hardware_id: str = param("", "hardware_id of the diagnostic status; '' = host name")


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


def rows_of(config_type: type, group: str, defaults: Optional[Mapping[str, Any]] = None) -> Tuple[ParamSpec, ...]:
    """The parameter rows of a config dataclass's fields (engine/config.py ``param``): ``<group>.<name>``,
    the field's default (``defaults`` by field name where the node's differs), description, range
    and choices; fields that are not parameters left out."""
    rows = []
    for field_name, meta in params_of(config_type):
        if not meta.node:
            continue
        default = (defaults or {}).get(field_name, _field_default(config_type, field_name))
        if meta.scale != 1:
            default //= meta.scale
        rows.append(ParamSpec(f"{group}.{meta.name or field_name}", default, meta.description, meta.range,
                              meta.choices, meta.yaml_false, meta.read_only))
    return tuple(rows)


def config_of(config_type: type, group: str, values: Mapping[str, Any], **fixed: Any) -> Any:
    """A config dataclass from the node's parameter values (each parameter field's ``<group>.<name>``,
    scaled), ``fixed`` for the fields written otherwise; ValueError with the reason, as its
    ``__post_init__`` says it."""
    kwargs = dict(fixed)
    for field_name, meta in params_of(config_type):
        if meta.node and field_name not in kwargs:
            value = values[f"{group}.{meta.name or field_name}"]
            kwargs[field_name] = value * meta.scale if meta.scale != 1 else value
    return config_type(**kwargs)


def _field_default(config_type: type, name: str) -> Any:
    return next(f.default for f in fields(config_type) if f.name == name)


_MODEL_PARAMS = dict(params_of(ModelConfig))


def _model_rows(prefix: str, what: str, path_default: str, path_help: str,
                with_batch: bool) -> Tuple[ParamSpec, ...]:
    """The rows shared by ``target.*`` and ``draft.*`` (ModelConfig's ranges; the draft's n_ctx 0 =
    the target's, its flash attention a choice, its batch the target's)."""
    def row(name: str, description: str, default: Any = None, low: Optional[float] = None) -> ParamSpec:
        meta = _MODEL_PARAMS[name]
        value_range = None if meta.range is None else (meta.range[0] if low is None else low, meta.range[1])
        return ParamSpec(f"{prefix}.{meta.name or name}",
                         _field_default(ModelConfig, name) if default is None else default, description, value_range)
    rows = [
        ParamSpec(f"{prefix}.model_path", path_default, path_help),
        row("n_gpu_layers", f"{what} layers offloaded to the GPU; -1 = all"),
        row("n_ctx", f"{what} context length in tokens (prompt + generation)" + ("" if with_batch else
                                                                                 "; 0 = target.n_ctx"),
            default=None if with_batch else 0, low=None if with_batch else 0),
        row("n_threads", f"CPU threads for the {what}; 0 = all cores"),
    ]
    if with_batch:
        rows += [
            row("n_batch", _MODEL_PARAMS["n_batch"].description),
            row("flash_attn", "flash attention for the target, and for the draft unless draft.flash_attn says "
                              "otherwise (faster on GPUs and CPUs; logits then depend on the batch)"),
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
    *rows_of(RemoteConfig, "remote"),
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
    *rows_of(SpecConfig, "spec"),
    *rows_of(LookupConfig, "lookup", defaults={"cache_dir": CACHE_DIR}),
    ParamSpec("suffix.history_path", _SUFFIX.history_path,
              "the suffix drafter's history of earlier outputs (spec.mode suffix, suffix+lookup): loaded "
              "if present, saved at cleanup/shutdown; only a file this node wrote for this vocabulary is "
              "read or replaced; a file name lies in lookup.cache_dir, an absolute path must too; not "
              "lookup.dynamic_path; '' = memory only"),
    *rows_of(SuffixConfig, "suffix"),
    *rows_of(ChatConfig, "chat"),
    *rows_of(TrafficSettings, "traffic"),
    *rows_of(GenerationDefaults, "generation"),
    *rows_of(SamplingParams, "generation"),
    *rows_of(Limits, "limits"),
    *rows_of(QueueSettings, "queue"),
    *rows_of(FeedbackSettings, "feedback"),
    *rows_of(DiagnosticsSettings, "diagnostics"),
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
    return config_of(SpecConfig, "spec", values)


def sampling_from(values: Mapping[str, Any]) -> SamplingParams:
    """``generation.*`` defaults -> SamplingParams; raises ValueError with a user-facing reason."""
    return config_of(SamplingParams, "generation", values)


def engine_config_from(values: Mapping[str, Any]) -> EngineConfig:
    """All parameters -> EngineConfig; raises ValueError with a user-facing reason.

    The draft model shares the target's ``n_batch``, and its ``flash_attn`` unless
    ``draft.flash_attn`` says otherwise; ``draft.n_ctx`` 0 means the target's context length.
    """
    target = config_of(ModelConfig, "target", values)
    draft = None
    if values["draft.model_path"]:
        flash_attn = values["draft.flash_attn"]
        draft = config_of(ModelConfig, "draft", values, n_batch=target.n_batch,
                          n_ctx=values["draft.n_ctx"] or target.n_ctx,
                          flash_attn=target.flash_attn if flash_attn == "target" else flash_attn == "enabled")
    cache_dir = values["lookup.cache_dir"]
    suffix = config_of(SuffixConfig, "suffix", values, cache_dir=cache_dir,
                       history_path=history_path(values["suffix.history_path"], cache_dir))
    queue = config_of(QueueSettings, "queue", values)
    return EngineConfig(target=target, draft=draft, spec=spec_config_from(values),
                        lookup=config_of(LookupConfig, "lookup", values), suffix=suffix,
                        chat=config_of(ChatConfig, "chat", values), max_running=queue.max_running,
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
    limits = config_of(Limits, "limits", values)
    return config_of(RemoteConfig, "remote", values, max_prompt_tokens=limits.max_prompt_tokens)


def check_values(values: Mapping[str, Any], configured: bool) -> str:
    """'' if a full set of parameter values is consistent, else the reason.

    Checks what the descriptors' ranges cannot: choices, cross-parameter rules and, while the node is
    unconfigured, the whole engine config (a configured node already holds a valid one and refuses
    configure-time changes).
    """
    reason = check_choices(values)
    if reason:
        return reason
    try:
        generation, limits = config_of(GenerationDefaults, "generation", values), config_of(Limits, "limits", values)
        if generation.max_tokens > limits.max_tokens:
            return (f"generation.max_tokens={generation.max_tokens} exceeds "
                    f"limits.max_tokens={limits.max_tokens}")
        sampling_from(values)
        # the default constraint, checked as a goal's is (parse and compile; cached by text)
        compiled_constraint(generation.grammar, generation.json_schema, limits.max_grammar_bytes)
        if configured:
            spec_config_from(values)
        else:
            engine_config_from(values)
            if values["backend"] == "remote":
                remote_config_from(values)
    except ValueError as exc:
        return str(exc)
    return ""


def render_markdown(rows: Sequence[ParamSpec] = PARAMETERS) -> str:
    """docs/parameters.md, generated from :data:`PARAMETERS` (or ``rows``)."""
    groups = ", ".join(f"`{p}*`" if p.endswith(".") else f"`{p}`" for p in CONFIGURE_TIME_PREFIXES)
    lines = [
        "# Parameters of the `gemma_spec` node",
        "",
        "Generated from `gemma_spec_ros/node/parameters.py` (the rows of the engine's settings from the",
        "fields of its config dataclasses, engine/config.py) by",
        "`python -m gemma_spec_ros.node.parameters --write docs/parameters.md`; do not edit by hand.",
        "",
        f"Configure-time parameters ({groups}) are read",
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
    for p in rows:
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
