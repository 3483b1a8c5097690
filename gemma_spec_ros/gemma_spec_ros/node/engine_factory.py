"""The engine the node's configure transition builds from its parameters, and its words for the log.

``backend: local`` is the :class:`~gemma_spec_ros.engine.engine.Engine` over the models in this
process; ``backend: remote`` a :class:`~gemma_spec_ros.engine.remote.RemoteEngine` over the server
at ``remote.url``, or with ``remote.fallback: local`` a
:class:`~gemma_spec_ros.engine.fallback.FallbackEngine` over it and a local Engine. The node holds
the result as a :class:`~gemma_spec_ros.engine.api.GenerationEngine` and calls nothing else on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..engine.api import GenerationEngine
from ..engine.engine import Engine
from ..engine.fallback import FallbackEngine
from ..engine.remote import RemoteEngine
from ..engine.types import EngineConfig, RemoteConfig
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


def build_engine(plan: EnginePlan) -> GenerationEngine:
    """Build the planned engine; a local engine already loaded is closed if the rest fails."""
    if plan.remote is None:
        return Engine(plan.config)
    local = Engine(plan.config) if plan.fallback_local else None
    try:
        primary = RemoteEngine(plan.remote, plan.config.spec)
    except BaseException:
        if local is not None:
            local.close()
        raise
    return primary if local is None else FallbackEngine(primary, local)


__all__ = ["EnginePlan", "build_engine", "plan_engine"]
