"""The engine-level tests' engine: one builder for a local Engine on a GGUF file (and its draft), and
one request run to its end on any engine (local, remote, fallback)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Union

from gemma_spec_ros.engine.api import GenerationEngine
from gemma_spec_ros.engine.config import EngineConfig, LookupConfig, ModelConfig, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.stats import SpecStats
from gemma_spec_ros.engine.request import GenerationRequest, Step


@dataclass(frozen=True)
class Generated:
    """Every step of one request, in order; the last one has ``finish_reason`` set."""

    steps: List[Step]

    @property
    def tokens(self) -> List[int]:
        """The tokens the steps emitted, in order."""
        return [token for step in self.steps for token in step.tokens]

    @property
    def text(self) -> str:
        return "".join(step.text for step in self.steps)

    @property
    def stats(self) -> SpecStats:
        """The request's stats at its end (the last step's)."""
        return self.steps[-1].stats


def collect(engine: GenerationEngine, request: GenerationRequest,
            cancel: Optional[threading.Event] = None) -> Generated:
    """Run ``request`` on ``engine`` to its end (an EngineError propagates)."""
    return Generated(list(engine.generate(request, cancel)))


def build_engine(target: Union[str, Path], draft: Union[str, Path, None] = None, *, n_ctx: int = 256,
                 n_threads: int = 0, spec: Optional[SpecConfig] = None, lookup: Optional[LookupConfig] = None,
                 calibrate: bool = False, max_running: int = 1, **target_options: Any) -> Engine:
    """A local Engine on the GGUF file ``target`` (and ``draft``, with the same ``n_ctx`` and
    ``n_threads``, as the engine requires of an assistant).

    ``target_options`` are the target's other ModelConfig fields (``n_batch``, ``flash_attn``...).
    Unlike the engine's own default, it skips the startup calibration unless ``calibrate=True``: most
    tests fix the draft length, and the warm-up passes only cost time; a test of what the policy
    learns from the measured costs asks for it. ``max_running`` > 1 serves that many requests at
    once (engine/slots.py).
    """
    config = EngineConfig(
        target=ModelConfig(str(target), n_ctx=n_ctx, n_threads=n_threads, **target_options),
        draft=None if draft is None else ModelConfig(str(draft), n_ctx=n_ctx, n_threads=n_threads),
        spec=SpecConfig() if spec is None else spec,
        lookup=LookupConfig() if lookup is None else lookup, max_running=max_running)
    return Engine(config, calibrate=calibrate)
