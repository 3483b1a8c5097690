"""``FallbackEngine``: a remote engine, and a local one for when its server cannot be reached.

Routing, per request:

1. the prober found the server down within its last two periods -> the local engine (no connect
   timeout to wait out);
2. else the remote engine; if it cannot connect (refused, unreachable, connect timeout:
   ServerUnreachableError before its first step) -> the local engine;
3. a stream that breaks after it started is not resumed locally: that goal ends with the error.

Configuration, checks and the context are the remote engine's (its server decides the speculation);
faults and load warnings are the local engine's. ``status()`` is the remote engine's, with which
backend served last, how many requests the local one served and why it last had to.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Iterator, List, Optional

from .api import GenerationEngine
from .remote.engine import RemoteEngine
from .remote.http import ServerUnreachableError
from .stats import SpecStats
from .request import CountedPrompt, GenerationRequest, Step
from .errors import EngineError, PromptTooLongError
from .config import SpecConfig


class FallbackEngine:
    """Routes each request to ``primary`` (remote) or ``local``; see the module docstring."""

    def __init__(self, primary: RemoteEngine, local: GenerationEngine) -> None:
        self.primary, self.local = primary, local
        self._lock = threading.Lock()
        self._last_served = ""
        self._served_local = 0
        self._last_reason = ""

    # -- the primary's configuration and checks ----------------------------------------------------
    @property
    def spec(self) -> SpecConfig:
        return self.primary.spec

    @property
    def n_ctx(self) -> int:
        return self.primary.n_ctx

    @property
    def warnings(self) -> List[str]:
        return self.local.warnings

    def check_spec(self, spec: SpecConfig) -> str:
        return self.primary.check_spec(spec)

    def update_spec(self, spec: SpecConfig) -> None:
        self.primary.update_spec(spec)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return self.primary.count_prompt_tokens(request)

    @property
    def max_running(self) -> int:
        """What both engines can serve at once: a request may move to the local one."""
        return min(self.primary.max_running, self.local.max_running)

    def count_prompt(self, request: GenerationRequest) -> CountedPrompt:
        return self.primary.count_prompt(request)

    def check_request(self, request: GenerationRequest, n_prompt_tokens: Optional[int] = None) -> None:
        self.primary.check_request(request, n_prompt_tokens)

    # -- routing -------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, cancel: Optional[threading.Event] = None,
                 prompt: Optional[CountedPrompt] = None) -> Iterator[Step]:
        """The primary's steps, or the local engine's (which counts the prompt itself: ``prompt``
        is the primary's)."""
        down = self.primary.known_down()
        if down:
            yield from self._locally(request, cancel, down)
            return
        steps = self.primary.generate(request, cancel, prompt)
        try:
            try:
                first = next(steps)
            except ServerUnreachableError as exc:
                yield from self._locally(request, cancel, str(exc))
                return
            except StopIteration:
                return
            self._note("remote", "")
            yield first
            yield from steps
        finally:
            steps.close()

    def _locally(self, request: GenerationRequest, cancel: Optional[threading.Event],
                 reason: str) -> Iterator[Step]:
        """The local engine's steps, after its own count of the prompt passed the limits the
        goal check could only estimate (``limits.max_prompt_tokens``, the local n_ctx)."""
        self._note("local", reason)
        try:  # the checks the node's goal check makes on the engine that serves (node/goals.py)
            prompt = self.local.count_prompt(request)
            limit = self.primary.config.max_prompt_tokens
            if limit and prompt.n_tokens > limit:
                raise PromptTooLongError(f"prompt has {prompt.n_tokens} tokens, more than "
                                         f"limits.max_prompt_tokens={limit} (counted by the local fallback)")
            self.local.check_request(request, prompt.n_tokens)
        except ValueError as exc:  # e.g. a chat template the local model lacks: this request's error
            raise EngineError(f"the local fallback cannot serve this request: {exc}") from None
        yield from self.local.generate(request, cancel, prompt)

    def _note(self, backend: str, reason: str) -> None:
        with self._lock:
            self._last_served = backend
            if backend == "local":
                self._served_local += 1
                self._last_reason = reason

    # -- what the node reads -------------------------------------------------------------------------
    def take_faults(self) -> List[str]:
        return self.local.take_faults()

    def rolling_stats(self) -> SpecStats:
        """The remote engine's (the local one's requests are reported by their own results)."""
        return self.primary.rolling_stats()

    def model_info(self) -> Dict[str, Any]:
        return {**self.primary.model_info(), "fallback": self.local.model_info().get("target")}

    def status(self) -> Dict[str, Any]:
        with self._lock:
            last, local, reason = self._last_served, self._served_local, self._last_reason
        return {**self.primary.status(), "served by": last or "none yet", "requests served local": local,
                "fallback": "local", "last fallback reason": reason}

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop the remote engine's prober, close the local engine (False: its running step keeps
        the models until it ends)."""
        self.primary.close(timeout)
        return self.local.close(timeout=timeout)


__all__ = ["FallbackEngine"]
