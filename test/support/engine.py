"""One request run to its end on any engine (local, remote, fallback), for the engine-level tests."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Optional

from gemma_spec_ros.engine.api import GenerationEngine
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
