"""What the bench runs: prompt suites, the node's parameters file, and the list of runners.

A **runner** is one way of generating text that the bench measures: an engine mode with a draft
length K, a llama-cpp-python baseline, one of llama.cpp's native tools, or a request through the
Generate action of a running node. Runners are plain data (:class:`RunnerSpec`) so they can be sent
to the worker process that runs each of them.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from gemma_spec_ros.engine import drafter_kinds
from gemma_spec_ros.engine.modes import MODES, SPEC_MODES
from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, expand_path
from gemma_spec_ros.node import parameters as node_parameters

PACKAGE = "gemma_spec_ros"
#: llama-cpp-python baselines: plain generation and its built-in prompt lookup.
BASELINES: Tuple[str, ...] = ("plain", "prompt-lookup")
#: Draft length of llama-cpp-python's built-in prompt lookup in the baseline (its documented example).
PROMPT_LOOKUP_TOKENS = 10
#: Name of the runner every speedup is measured against.
REFERENCE_RUNNER = "off"


# -- prompt suites ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One completion-style prompt of a suite."""

    suite: str
    id: str
    text: str


@dataclass(frozen=True)
class Suite:
    """A named set of prompts loaded from ``prompts/<name>.yaml``."""

    name: str
    description: str
    order: int
    prompts: Tuple[Prompt, ...]
    #: the JSON Schema its answers must follow (``json_schema_file``, relative to the suite file)
    json_schema_path: Optional[Path] = None


def share_dirs() -> List[Path]:
    """``share/gemma_spec_ros`` folders to look in: the source tree first (the package folder
    gemma_spec_ros/ beside this one in the repository), then installed prefixes."""
    dirs = [Path(__file__).resolve().parents[3] / PACKAGE]
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) + [sys.prefix]:
        if prefix:
            dirs.append(Path(prefix) / "share" / PACKAGE)
    return dirs


def find_data_dir(name: str) -> Optional[Path]:
    """The first ``<share dir>/<name>`` folder that exists (``prompts`` or ``config``)."""
    for base in share_dirs():
        if (base / name).is_dir():
            return base / name
    return None


def load_suite(path: Path) -> Suite:
    """Read one suite file; raises ValueError with the file name on a malformed file."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    name = str(data.get("name") or path.stem)
    items = data.get("prompts") or []
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: 'prompts' must be a non-empty list")
    system = str(data.get("system") or "")  # one text every prompt starts with (a planner's)
    prompts: List[Prompt] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not item.get("id") or not item.get("text"):
            raise ValueError(f"{path}: prompt #{i + 1} needs a non-empty 'id' and 'text'")
        text = f"{system}\n\n{item['text']}" if system else str(item["text"])
        prompts.append(Prompt(name, str(item["id"]), text))
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: prompt ids must be unique")
    schema = data.get("json_schema_file")
    schema_path = (path.parent / str(schema)).resolve() if schema else None
    if schema_path is not None and not schema_path.is_file():
        raise ValueError(f"{path}: json_schema_file {schema} not found")
    return Suite(name, str(data.get("description", "")), int(data.get("order", 100)), tuple(prompts),
                 schema_path)


def load_suites(directory: Path) -> List[Suite]:
    """All suites of a folder, in their ``order`` (then name)."""
    suites = [load_suite(p) for p in sorted(directory.glob("*.yaml"))]
    if not suites:
        raise ValueError(f"no prompt suites (*.yaml) in {directory}")
    return sorted(suites, key=lambda s: (s.order, s.name))


def select_suites(suites: Sequence[Suite], names: str) -> List[Suite]:
    """``all``, ``none`` or a comma-separated list of suite names (unknown names raise ValueError)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if wanted == ["none"]:
        return []
    if not wanted or wanted == ["all"]:
        return list(suites)
    by_name = {s.name: s for s in suites}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"unknown suite(s) {', '.join(unknown)}; have {', '.join(by_name)}")
    return [by_name[n] for n in wanted]


# -- node parameters -------------------------------------------------------------------------------
def flatten(tree: Mapping[str, object], prefix: str = "") -> Dict[str, object]:
    """Nested mappings to dotted keys, as ROS 2 reads a parameters file.

    >>> flatten({"target": {"model_path": "m.gguf", "n_ctx": 512}, "spec.mode": "off"})
    {'target.model_path': 'm.gguf', 'target.n_ctx': 512, 'spec.mode': 'off'}
    """
    out: Dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def load_params(path: str) -> Dict[str, object]:
    """The parameters of a node params file (``/**: ros__parameters: ...`` or ``<node>: ...``),
    flattened to dotted keys, as the node declares them (an unquoted ``off``: the string). The
    first node section with ``ros__parameters`` is used."""
    with open(expand_path(path), encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a ROS 2 parameters file (expected a mapping)")
    for section in data.values():
        if isinstance(section, dict) and isinstance(section.get("ros__parameters"), dict):
            return node_parameters.as_declared(flatten(section["ros__parameters"]))
    raise ValueError(f"{path}: no 'ros__parameters' section (expected '/**: ros__parameters: ...')")


def default_params() -> Dict[str, object]:
    """Parameters when no --config is given: the installed config/embedded.yaml if there is one,
    else the defaults (the embedded model)."""
    config_dir = find_data_dir("config")
    if config_dir is not None and (config_dir / "embedded.yaml").is_file():
        return load_params(str(config_dir / "embedded.yaml"))
    return {}


def base_config(params: Mapping[str, object]) -> EngineConfig:
    """The EngineConfig the node builds from these parameters (unset ones take the node's defaults),
    with speculation ``off`` (each engine runner sets its own mode). Raises ValueError on a bad value
    or an unknown parameter name. The node's own mapping, which imports no ROS: the bench also runs
    where ROS is not installed (the GPU machine)."""
    unknown = sorted(set(params) - set(node_parameters.PARAMETERS_BY_NAME))
    if unknown:
        raise ValueError(f"unknown parameters {', '.join(unknown)} (see docs/parameters.md)")
    # the learned cache and the suffix history stay in memory: a benchmark never writes the node's
    # files, and a fresh worker per repeat starts from the same state
    config = node_parameters.engine_config_from(
        {**node_parameters.defaults(), **params, "lookup.dynamic_path": "", "suffix.history_path": ""})
    return dataclasses.replace(config, spec=dataclasses.replace(config.spec, mode="off"))


def engine_config(params: Mapping[str, object], mode: str, draft_max: Optional[int],
                  adaptive_max: Optional[int] = None) -> EngineConfig:
    """EngineConfig for one engine runner: the file's settings with the runner's mode and K.

    ``draft_max`` None keeps the configured K (or ``adaptive_max``) and the adaptive policy; a number
    fixes K (policy off). The dynamic n-gram cache stays in memory (see :func:`base_config`).
    """
    base = base_config(params)
    spec = dataclasses.replace(base.spec, mode=mode)
    if draft_max is None and adaptive_max is not None:
        spec = dataclasses.replace(spec, draft_max=adaptive_max, draft_min=min(spec.draft_min, adaptive_max))
    if draft_max is not None:
        spec = dataclasses.replace(spec, draft_max=draft_max, adaptive=False,
                                   draft_min=min(spec.draft_min, draft_max))
    return dataclasses.replace(base, spec=spec)


def model_config(params: Mapping[str, object], role: str) -> Optional[ModelConfig]:
    """The ``target`` or ``draft`` ModelConfig of these parameters (None: no draft model)."""
    return getattr(base_config(params), role)


def apply_overrides(params: Mapping[str, object], target: str, draft: str) -> Dict[str, object]:
    """--target / --draft model paths over the file's (``draft='none'`` removes the draft)."""
    out = dict(params)
    if target:
        out["target.model_path"] = target
    if draft:
        out["draft.model_path"] = "" if draft == "none" else draft
    return out


def thread_count(params: Mapping[str, object]) -> int:
    """CPU threads the engine uses (``target.n_threads``; 0 = all cores): baselines get the same."""
    n = base_config(params).target.n_threads
    return n if n > 0 else (os.cpu_count() or 1)


# -- runners ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunnerSpec:
    """One measured way of generating text.

    kind: ``engine`` (our engine in a mode), ``llama-cpp`` (llama-cpp-python baseline), ``native``
    (a llama.cpp example binary), ``action`` (the Generate action of a running node).
    """

    name: str
    kind: str
    mode: str = ""  # engine/action: spec mode; llama-cpp: plain | prompt-lookup; native: tool
    draft_max: Optional[int] = None  # K; None = the configured K with the adaptive policy
    reference: str = REFERENCE_RUNNER  # runner whose tokens/s this one's "own baseline" ratio uses
    reuse_prompt: bool = True  # engine: keep the previous request's KV prefix (generation.prompt_cache)
    native_args: Tuple[str, ...] = ()  # native: extra arguments of the tool (an n-gram --spec-type)
    adaptive_max: Optional[int] = None  # engine, adaptive: the policy's cap K (None: the configured)

    @property
    def k_label(self) -> str:
        if self.draft_max is None:
            return "adaptive" if self.adaptive_max is None else f"adaptive<={self.adaptive_max}"
        return str(self.draft_max)


def runner_name(mode: str, draft_max: Optional[int]) -> str:
    """``lookup`` for the adaptive policy, ``lookup/K3`` for a fixed K; ``off`` has no K."""
    return mode if draft_max is None or mode == "off" else f"{mode}/K{draft_max}"


def parse_modes(text: str) -> List[str]:
    """``all`` or a comma-separated list of SPEC_MODES."""
    wanted = [m.strip() for m in text.split(",") if m.strip()]
    if not wanted or wanted == ["all"]:
        return list(SPEC_MODES)
    unknown = [m for m in wanted if m not in SPEC_MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; expected {', '.join(SPEC_MODES)} or all")
    return wanted


def parse_ks(text: str) -> List[Optional[int]]:
    """``2,3,4,8,adaptive`` -> [2, 3, 4, 8, None] (None = adaptive policy)."""
    out: List[Optional[int]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item == "adaptive":
            out.append(None)
            continue
        try:
            k = int(item)
        except ValueError:
            raise ValueError(f"--k item {item!r}: expected an integer or 'adaptive'") from None
        if not 1 <= k <= 64:
            raise ValueError(f"--k {k}: must be in [1, 64]")
        out.append(k)
    if not out:
        raise ValueError("--k is empty")
    return list(dict.fromkeys(out))


def parse_baselines(text: str) -> List[str]:
    """``on``/``all`` (both), ``none``/``off``, or a comma-separated list of BASELINES."""
    text = text.strip()
    if text in ("on", "all", ""):
        return list(BASELINES)
    if text in ("none", "off"):
        return []
    wanted = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in wanted if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; expected {', '.join(BASELINES)}")
    return wanted


NATIVE_TOOLS: Dict[str, str] = {"lookup": "llama-lookup", "speculative": "llama-speculative-simple",
                                # the same tool with --spec-type draft-mtp: a Gemma 4 assistant as -md
                                "speculative-mtp": "llama-speculative-simple",
                                # and with --spec-type draft-eagle3: an EAGLE-3 head as -md
                                "speculative-eagle3": "llama-speculative-simple",
                                # the same tool with an n-gram --spec-type: no draft model
                                "speculative-ngram": "llama-speculative-simple"}

#: ``--native-sweep``: the draft lengths of ``llama-lookup`` (besides ``--native-k``).
NATIVE_SWEEP_LOOKUP_KS: Tuple[int, ...] = (3, 5, 8)
#: ``--native-sweep``: ``llama-speculative-simple``'s n-gram methods, each with llama.cpp's defaults
#: (tuned for long repeated contexts: n-gram keys of 12 tokens; ngram-mod 24-token keys and no draft
#: shorter than 48 tokens) and with short keys that can match in a prompt of a few hundred tokens. Runner name
#: ``native-<type>[/<variant>]`` -> the tool's arguments. ngram-cache drafts 8 tokens (fixed in the
#: tool), the others their m-gram / n_max.
NATIVE_NGRAM_SETTINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("ngram-cache", ("--spec-type", "ngram-cache")),
    ("ngram-simple", ("--spec-type", "ngram-simple")),
    ("ngram-simple/n3m8", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                           "--spec-ngram-simple-size-m", "8")),
    ("ngram-simple/n2m16", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                            "--spec-ngram-simple-size-m", "16")),
    ("ngram-map-k", ("--spec-type", "ngram-map-k")),
    ("ngram-map-k/n3m8", ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                          "--spec-ngram-map-k-size-m", "8")),
    ("ngram-mod", ("--spec-type", "ngram-mod")),
    ("ngram-mod/n4", ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4",
                      "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "16")),
)


#: ``--prompt-reuse`` choices: engine runners with prompt reuse, without, or both side by side.
PROMPT_REUSE_CHOICES: Tuple[str, ...] = ("on", "off", "both")
#: Name suffix of an engine runner that evaluates every prompt whole.
NO_REUSE_SUFFIX = "/no-reuse"


def parse_native_sweep(text: str) -> Tuple[str, ...]:
    """``--native-sweep``: '' (no sweep), ``all``, or names of :data:`NATIVE_NGRAM_SETTINGS` -> the
    names of the llama-speculative-simple settings to run (llama-lookup's Ks come with any sweep).

    >>> parse_native_sweep("ngram-cache, ngram-mod/n4")
    ('ngram-cache', 'ngram-mod/n4')
    """
    known = [name for name, _ in NATIVE_NGRAM_SETTINGS]
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if wanted == ["all"]:
        return tuple(known)
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"--native-sweep: unknown setting(s) {', '.join(unknown)}; have all, {', '.join(known)}")
    return tuple(wanted)


def plan_runners(modes: Sequence[str], ks: Sequence[Optional[int]], has_draft: bool,
                 baselines: Sequence[str], native_bin: str, native_ks: Sequence[int],
                 via_action: str, prompt_reuse: str = "on",
                 model_kind: str = "draft", native_sweep: Sequence[str] = (),
                 adaptive_ks: Sequence[int] = ()) -> Tuple[List[RunnerSpec], List[str]]:
    """The runners of one bench invocation and notes on what was skipped and why.

    ``off`` is always run (every speedup is measured against it). Each other mode runs once per K.
    ``prompt_reuse`` ``off`` runs the engine runners without prompt reuse; ``both`` adds a
    ``<name>/no-reuse`` twin of each, whose own baseline is the runner with reuse. ``model_kind``: the
    registered drafter kind that runs the draft model (``drafters/registry.py``'s ``model_kind``): ``mtp``
    for a Gemma 4 MTP assistant, which drafts in mode ``mtp`` (and for llama.cpp's
    ``llama-speculative-simple --spec-type draft-mtp``), never in the draft-model modes; ``eagle3``
    for an EAGLE-3 head, which drafts in mode ``eagle3`` (and ``--spec-type draft-eagle3``).
    ``native_sweep``: the n-gram settings of llama.cpp's tools to sweep, by name (see
    :func:`_native_runners`; empty: no sweep).
    ``adaptive_ks``: more adaptive runners per mode, each with that cap on K (``lookup/A8``).
    """
    notes: List[str] = []
    kind = model_kind  # the drafter draft.model_path loads
    specs: List[RunnerSpec] = [RunnerSpec(REFERENCE_RUNNER, "engine", "off", None, "")]
    for mode in modes:
        if mode == "off":
            continue
        needs = MODES[mode].needs
        if needs == "draft" and not has_draft:
            notes.append(f"mode {mode} skipped: no draft model configured (draft.model_path or --draft)")
            continue
        if needs and needs != kind:
            if has_draft and kind != "draft":
                held = f"the draft model is {drafter_kinds.get(kind).model} (mode {kind})"
            else:
                held = f"it needs {drafter_kinds.get(needs).model}, and none is configured"
            notes.append(f"mode {mode} skipped: {held}")
            continue
        specs.extend(RunnerSpec(runner_name(mode, k), "engine", mode, k) for k in ks)
        specs.extend(RunnerSpec(f"{mode}/A{k}", "engine", mode, None, adaptive_max=k) for k in adaptive_ks)
    if prompt_reuse not in PROMPT_REUSE_CHOICES:
        raise ValueError(f"--prompt-reuse {prompt_reuse!r}: expected one of {', '.join(PROMPT_REUSE_CHOICES)}")
    if prompt_reuse == "off":
        specs = [replace(s, reuse_prompt=False) for s in specs]
    elif prompt_reuse == "both":
        specs += [replace(s, name=s.name + NO_REUSE_SUFFIX, reference=s.name, reuse_prompt=False)
                  for s in list(specs)]
    if "plain" in baselines:
        specs.append(RunnerSpec("lcp-plain", "llama-cpp", "plain", None))
    if "prompt-lookup" in baselines:
        specs.append(RunnerSpec("lcp-prompt-lookup", "llama-cpp", "prompt-lookup", PROMPT_LOOKUP_TOKENS,
                                "lcp-plain" if "plain" in baselines else REFERENCE_RUNNER))
    if native_bin:
        specs.extend(_native_runners(native_bin, native_ks, has_draft, notes, model_kind == "mtp", native_sweep,
                                     model_kind == "eagle3"))
    elif native_sweep:
        notes.append("--native-sweep skipped: no --native-bin")
    if via_action:
        specs.extend(RunnerSpec(f"action:{s.name}", "action", s.mode, None, s.name)
                     for s in list(specs) if s.kind == "engine" and s.draft_max is None)
    return specs, notes


def _native_runners(native_bin: str, native_ks: Sequence[int], has_draft: bool,
                    notes: List[str], assistant: bool = False,
                    sweep: Sequence[str] = (), head: bool = False) -> List[RunnerSpec]:
    """llama-lookup with K=0 (its plain decoding) and each K; llama-speculative-simple with a draft
    (``--spec-type draft-mtp`` when it is a Gemma 4 assistant: ``native-spec-mtp/K*``;
    ``--spec-type draft-eagle3`` when it is an EAGLE-3 head: ``native-spec-eagle3/K*``). ``sweep``
    (names of :data:`NATIVE_NGRAM_SETTINGS`) adds llama-lookup at :data:`NATIVE_SWEEP_LOOKUP_KS` and
    llama-speculative-simple with those settings (``native-ngram-*``, no draft model): the settings the per-prompt
    native oracle picks from (report.summary.versus_native_oracle)."""
    bin_dir = Path(expand_path(native_bin))
    specs: List[RunnerSpec] = []
    if sweep:
        native_ks = sorted(set(native_ks) | set(NATIVE_SWEEP_LOOKUP_KS))
    if (bin_dir / NATIVE_TOOLS["lookup"]).is_file():
        specs.append(RunnerSpec("native-plain", "native", "lookup", 0))
        specs.extend(RunnerSpec(f"native-lookup/K{k}", "native", "lookup", k, "native-plain")
                     for k in native_ks)
    else:
        notes.append(f"native lookup skipped: {bin_dir / NATIVE_TOOLS['lookup']} not found "
                     "(scripts/build_native_tools.sh builds it)")
    if not has_draft:
        notes.append("native speculative skipped: no draft model configured")
    elif (bin_dir / NATIVE_TOOLS["speculative"]).is_file():
        reference = "native-plain" if specs else REFERENCE_RUNNER
        tool, name = (("speculative-mtp", "native-spec-mtp") if assistant else
                      ("speculative-eagle3", "native-spec-eagle3") if head else ("speculative", "native-spec"))
        specs.extend(RunnerSpec(f"{name}/K{k}", "native", tool, k, reference) for k in native_ks)
    else:
        notes.append(f"native speculative skipped: {bin_dir / NATIVE_TOOLS['speculative']} not found")
    if sweep and (bin_dir / NATIVE_TOOLS["speculative-ngram"]).is_file():
        reference = "native-plain" if specs and specs[0].name == "native-plain" else REFERENCE_RUNNER
        specs.extend(RunnerSpec(f"native-{name}", "native", "speculative-ngram", None, reference,
                                native_args=args) for name, args in NATIVE_NGRAM_SETTINGS if name in sweep)
    elif sweep:
        notes.append(f"native n-gram sweep skipped: {bin_dir / NATIVE_TOOLS['speculative-ngram']} not found")
    return specs


__all__ = [
    "BASELINES", "NATIVE_NGRAM_SETTINGS", "NATIVE_SWEEP_LOOKUP_KS", "NATIVE_TOOLS",
    "PROMPT_LOOKUP_TOKENS", "Prompt",
    "REFERENCE_RUNNER", "RunnerSpec", "Suite", "apply_overrides", "base_config", "default_params",
    "engine_config",
    "find_data_dir", "flatten", "load_params", "load_suite", "load_suites", "model_config",
    "parse_baselines", "parse_ks", "parse_modes", "parse_native_sweep", "plan_runners", "runner_name", "select_suites",
    "thread_count",
]
