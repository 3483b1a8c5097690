"""``GenerationEngine``: the one contract the node holds its engine by.

Three classes implement it: :class:`~gemma_spec_ros.engine.engine.Engine` (the models in this
process), :class:`~gemma_spec_ros.engine.remote.engine.RemoteEngine` (an OpenAI-compatible server)
and :class:`~gemma_spec_ros.engine.fallback.FallbackEngine` (a remote engine with a local one for
when its server is unreachable). The node holds an engine by this contract only, so a goal can be
followed from the node into whichever engine serves it; tools (the bench, the CLI, the tests) also
use ``check_spec`` and ``count_prompt_tokens``, which the node does not need.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Iterator, List, Optional, Protocol, runtime_checkable

from .stats import SpecStats
from .request import CountedPrompt, GenerationRequest, Step
from .config import SpecConfig


@runtime_checkable
class GenerationEngine(Protocol):
    """What the node asks of an engine; see :mod:`gemma_spec_ros.engine.engine` for the semantics.

    Thread use: ``count_prompt`` and ``check_request`` run in the node's goal callback (they must
    answer quickly: cancels wait behind them); ``generate`` runs at most ``max_running`` requests at
    a time (the node's queue sees to it), each in its own thread; ``status`` and ``rolling_stats``
    run on the diagnostics timer.
    """

    @property
    def max_running(self) -> int:
        """How many requests ``generate`` serves at once (1: one at a time)."""

    @property
    def spec(self) -> SpecConfig:
        """The SpecConfig in effect (frozen)."""

    @property
    def n_ctx(self) -> int:
        """The context length a request must fit (tokens); 0 if unknown (no check)."""

    @property
    def warnings(self) -> List[str]:
        """Problems recovered from while loading (e.g. a corrupt cache moved aside), for the log."""

    def check_spec(self, spec: SpecConfig) -> str:
        """Why ``spec`` cannot be used here; '' if it can."""

    def update_spec(self, spec: SpecConfig) -> None:
        """Use ``spec`` from the next step on; ValueError(reason) if it cannot be used."""

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """The request's prompt tokens (an engine without a tokenizer at hand may estimate low)."""

    def count_prompt(self, request: GenerationRequest) -> CountedPrompt:
        """The request's prompt counted (as ``count_prompt_tokens``), with the tokens where this
        engine tokenizes locally, for ``check_request`` and then ``generate``."""

    def check_request(self, request: GenerationRequest, n_prompt_tokens: Optional[int] = None) -> None:
        """PromptTooLongError if the prompt and max_tokens exceed the context; ValueError if the
        request's spec_mode cannot be used here. ``n_prompt_tokens`` saves counting again."""

    def generate(self, request: GenerationRequest, cancel: Optional[threading.Event] = None,
                 prompt: Optional[CountedPrompt] = None) -> Iterator[Step]:
        """Steps of one request; the last has ``finish_reason`` set. Raises EngineError.

        ``prompt``: this engine's ``count_prompt`` of the request, whose count ``check_request``
        has passed; an engine that tokenizes here then neither tokenizes nor checks it again."""

    def take_faults(self) -> List[str]:
        """Problems outside any request since the last call (e.g. a failed cache save)."""

    def rolling_stats(self) -> SpecStats:
        """SpecStats over all requests so far (a copy)."""

    def model_info(self) -> Dict[str, Any]:
        """The models served: {"target": {...}, "draft": {...} or None, ...}."""

    def status(self) -> Dict[str, Any]:
        """Key-values /diagnostics shows of this engine; at least ``backend`` and ``served by``."""

    def close(self, timeout: Optional[float] = None) -> bool:
        """Free everything (idempotent); False if a running step keeps the models until it ends."""


__all__ = ["GenerationEngine"]
