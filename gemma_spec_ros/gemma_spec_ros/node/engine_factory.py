"""The engine the node's configure transition builds from its parameters, and its words for the log.

``backend: local`` is the :class:`~gemma_spec_ros.engine.engine.Engine` over the models in this
process; ``backend: remote`` a :class:`~gemma_spec_ros.engine.remote.RemoteEngine` over the server
at ``remote.url``, or with ``remote.fallback: local`` a
:class:`~gemma_spec_ros.engine.fallback.FallbackEngine` over it and a local Engine. The node holds
the result as a :class:`~gemma_spec_ros.engine.api.GenerationEngine` and calls nothing else on it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

from ..engine.drafters import learned_cache, suffix_history
from ..engine.api import GenerationEngine
from ..engine.engine import Engine
from ..engine.fallback import FallbackEngine
from ..engine.remote import RemoteEngine
from ..engine.drafters.ngram_cache import CacheFileNotFoundError
from ..engine.config import EngineConfig, expand_path
from ..engine.errors import ModelLoadError
from ..engine.remote.config import RemoteConfig
from .parameters import engine_config_from, remote_config_from


@dataclass(frozen=True)
class EnginePlan:
    """What configure builds: the local engine's config, and the server's for ``backend: remote``."""

    config: EngineConfig
    remote: Optional[RemoteConfig] = None  # None: backend local
    fallback_local: bool = False  # with a remote: a local engine serves while the server is down

    @property
    def loads_models(self) -> bool:
        return self.remote is None or self.fallback_local

    def describe(self) -> str:
        """The models (or the server) it uses, for the log and a configure failure's reason."""
        files = f"target {self.config.target.resolved_path!r}"
        if self.config.draft is not None:
            files += f", draft {self.config.draft.resolved_path!r}"
        if self.remote is None:
            return files
        return f"server {self.remote.url}" + (f" (fallback: {files})" if self.fallback_local else "")


def plan_engine(values: Mapping[str, Any]) -> EnginePlan:
    """The engine ``backend`` names, from checked parameter values (ValueError: a bad value)."""
    config = engine_config_from(values)
    if values["backend"] != "remote":
        return EnginePlan(config)
    return EnginePlan(config, remote_config_from(values), values["remote.fallback"] == "local")


def check_model_file(path: str) -> None:
    """Raise ModelLoadError unless ``path`` is a readable file that starts as a GGUF does (4 bytes
    read; the load itself says the same of the file it opens, in the same words)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file not found: {path}")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as error:
        raise ModelLoadError(f"cannot read model file {path}: {error.strerror or error}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"not a GGUF file (bad magic): {path}")


def check_files(plan: EnginePlan) -> List[str]:
    """Check every local file the plan reads or writes before any model loads; the folders created
    for the learned n-gram cache and the suffix history
    (see :func:`~gemma_spec_ros.engine.drafters.learned_cache.prepare_folder`).

    Loading a 4 GB target takes tens of seconds on an Orin: a missing draft file, static cache or
    cache folder must fail configure at once, not after that load. Raises an EngineError naming the
    file: a model that is not a readable GGUF, a static cache that does not exist, a learned-cache
    folder that cannot be made, or a file at ``lookup.dynamic_path`` or ``suffix.history_path``
    this node did not write (it is never overwritten), a chat template file that does not exist.
    What needs the loaded target (the files' vocabulary, a corrupt record) is checked when it loads.
    """
    if not plan.loads_models:
        return []
    config = plan.config
    for model in (config.target, config.draft):
        if model is not None:
            check_model_file(model.resolved_path)
    template = expand_path(config.chat.template_path)
    if template and not os.path.isfile(template):
        raise ModelLoadError(f"chat template file not found: {template} (chat.template_path)")
    lookup = config.lookup
    static = expand_path(lookup.static_path)
    if static and not os.path.isfile(static):
        raise CacheFileNotFoundError(f"n-gram cache file {static} (lookup.static_path) does not exist "
                                     "(build a static cache with gemma-spec-lookup-create)")
    created: List[str] = []
    dynamic = expand_path(lookup.dynamic_path)
    if dynamic:
        created += learned_cache.prepare_folder(dynamic, expand_path(lookup.cache_dir))
        learned_cache.check_loadable(dynamic)
    history = expand_path(config.suffix.history_path)
    if history:
        created += learned_cache.prepare_folder(history, expand_path(config.suffix.cache_dir))
        suffix_history.check_loadable(history)
    return created


def build_engine(plan: EnginePlan) -> GenerationEngine:
    """Build the planned engine; a local engine already loaded is closed if the rest fails."""
    if plan.remote is None:
        return Engine(plan.config)
    local = Engine(plan.config) if plan.fallback_local else None
    try:
        primary = RemoteEngine(plan.remote, plan.config.spec, plan.config.max_running)
    except BaseException:
        if local is not None:
            local.close()
        raise
    return primary if local is None else FallbackEngine(primary, local)


__all__ = ["EnginePlan", "build_engine", "check_files", "plan_engine"]
