"""What the remote engine knows of its server: reachability (a prober thread), kind, context length,
tokenizer, and the "idle gate" for servers that cannot answer while they stream.

Kinds, told apart by the endpoints they answer: llama.cpp's ``llama-server`` (``/props``), vLLM
(``max_model_len`` in ``/v1/models``), llama-cpp-python's ``llama_cpp.server``
(``/extras/tokenize/count``), else a plain OpenAI-compatible server. llama_cpp.server serves one
request at a time and, by default, a new request interrupts the running stream: it is asked for
anything that needs its model (tokenize, /v1/models) only while the engine is not streaming, and
one such server should serve one robot (or run with ``--interrupt_requests false``).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, TypeVar

from ..types import RemoteConfig
from .http import HttpClient, RemoteError
from .metrics import Counters, TauAttribution, parse_prometheus

KIND_LLAMA_SERVER = "llama.cpp server"
KIND_LLAMA_CPP_PYTHON = "llama-cpp-python server"
KIND_VLLM = "vllm"
KIND_OPENAI = "openai-compatible"
#: Kinds that speak llama.cpp's sampler (top_k 0 = no limit, repeat_penalty, grammar, json_schema).
LLAMA_CPP_KINDS = (KIND_LLAMA_SERVER, KIND_LLAMA_CPP_PYTHON)

T = TypeVar("T")


@dataclass(frozen=True)
class ProbeResult:
    """What the last probe of the server found."""

    reachable: Optional[bool] = None  # None: not probed yet
    rtt: float = math.nan  # seconds of the last GET /health (any HTTP answer counts)
    checked_at: float = math.nan  # time.monotonic() of the last probe
    error: str = ""


def read_counters(client: HttpClient) -> Optional[Counters]:
    """The server's speculation counters from GET /metrics; None if it has none or did not answer."""
    try:
        status, body = client.get("/metrics")
    except RemoteError:
        return None
    if status != 200:
        return None
    counters = parse_prometheus(body.decode("utf-8", "replace"))
    return counters if "spec_decode_num_drafts" in counters else None


class ServerProbe:
    """Reachability and identity of the server at ``client``; a prober thread every
    ``config.probe_period`` seconds (none when 0). ``busy`` is the engine's generation lock: the
    idle gate (:meth:`when_idle`) takes it without blocking. ``tau`` learns here whether the server
    has counters, and takes a reading at every probe."""

    def __init__(self, client: HttpClient, config: RemoteConfig, busy: threading.Lock,
                 tau: TauAttribution) -> None:
        self._client, self._config, self._busy, self._tau = client, config, busy, tau
        self._lock = threading.Lock()
        self._last = ProbeResult()
        self.kind = ""  # which server (detected once reachable); '' = not yet known
        self.n_ctx = 0  # as the server reports it; 0 = unknown
        self.model = ""  # the server's model id, '' if it names none
        self.tokenizer = "estimate"  # what counted the last request's prompt
        self._closed = threading.Event()
        self.probe()
        self._thread: Optional[threading.Thread] = None
        if config.probe_period > 0:
            self._thread = threading.Thread(target=self._loop, name="gemma_spec_remote_probe", daemon=True)
            self._thread.start()

    @property
    def last(self) -> ProbeResult:
        with self._lock:
            return replace(self._last)

    def probe(self) -> bool:
        """GET /health once: reachability and round-trip time (any HTTP answer counts: llama_cpp.server
        has no /health and answers 404 without touching its model lock). Detects the server's kind
        the first time it is reachable and reads /metrics. Returns reachability."""
        started = time.perf_counter()
        try:
            status, _ = self._client.get("/health")
        except RemoteError as exc:
            self.mark(False, math.nan, str(exc))
            return False
        self.mark(True, time.perf_counter() - started, "" if status < 500 else f"/health: HTTP {status}")
        if not self.kind and status < 500:  # llama-server answers 503 while it loads the model
            self.when_idle(self._detect)
        self._tau.observe()
        return True

    def mark(self, reachable: bool, rtt: float, error: str) -> None:
        """Record a probe's (or a request's) finding about the server."""
        with self._lock:
            self._last = ProbeResult(reachable, rtt, time.monotonic(), error)

    def known_down(self) -> str:
        """The last probe's error if the running prober found the server unreachable within its
        last two periods, else '' (then a request tries to connect)."""
        if self._thread is None:
            return ""
        last = self.last
        fresh = time.monotonic() - last.checked_at <= 2 * self._config.probe_period
        return last.error if last.reachable is False and fresh else ""

    def when_idle(self, call: Callable[[], T]) -> Optional[T]:
        """``call()`` while no generation of the engine runs (it holds the generation lock
        meanwhile), else None: llama_cpp.server interrupts a running stream at any request that
        needs its model (tokenize, /v1/models)."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return call()
        finally:
            self._busy.release()

    def count_tokens(self, text: str, timeout: float) -> Optional[int]:
        """``text``'s tokens by the server's tokenizer; None if it has none or did not answer."""
        kind = "" if self.last.reachable is False else self.kind  # no wait on a server found down
        post = self._client.post_json
        reply: Optional[Any] = None
        count = None
        if kind == KIND_LLAMA_SERVER:
            reply = post("/tokenize", {"content": text, "add_special": True}, timeout)
            count = len(reply["tokens"]) if isinstance(reply, dict) and "tokens" in reply else None
        elif kind == KIND_VLLM:
            body = {"prompt": text, **({"model": self._config.model} if self._config.model else {})}
            reply = post("/tokenize", body, timeout)
            count = reply.get("count") if isinstance(reply, dict) else None
        elif kind == KIND_LLAMA_CPP_PYTHON:
            reply = self.when_idle(lambda: post("/extras/tokenize/count", {"input": text}, timeout))
            count = reply.get("count") if isinstance(reply, dict) else None
        self.tokenizer = f"{kind} tokenizer" if count is not None else "estimate"
        return int(count) if count is not None else None

    def close(self) -> None:
        """Stop the prober (it may be inside a probe: up to a few connect timeouts)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=self._config.connect_timeout * 3 + 1.0)
            self._thread = None

    def _loop(self) -> None:
        while not self._closed.wait(self._config.probe_period):
            try:
                self.probe()
            except Exception as exc:  # noqa: BLE001  a probe must never kill its thread
                self.mark(False, math.nan, f"probe failed: {exc!r}")

    def _detect(self) -> None:
        """Which server this is, from the endpoints it answers; its n_ctx and /metrics."""
        kind = KIND_OPENAI
        props = self._client.get_json("/props")
        models = self._client.get_json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        if isinstance(props, dict) and "default_generation_settings" in props:
            kind = KIND_LLAMA_SERVER
            settings = props.get("default_generation_settings") or {}
            self.n_ctx = int(settings.get("n_ctx") or props.get("n_ctx") or 0)
        elif "max_model_len" in entry:
            kind = KIND_VLLM
            self.n_ctx = int(entry.get("max_model_len") or 0)
        elif self._client.post_json("/extras/tokenize/count", {"input": "a"}, self._config.connect_timeout):
            kind = KIND_LLAMA_CPP_PYTHON
        self.model = str(entry.get("id") or "")
        self.kind = kind
        self._tau.available = (kind in (KIND_LLAMA_SERVER, KIND_VLLM)
                               and read_counters(self._client) is not None)


__all__ = ["KIND_LLAMA_CPP_PYTHON", "KIND_LLAMA_SERVER", "KIND_OPENAI", "KIND_VLLM", "LLAMA_CPP_KINDS",
           "ProbeResult", "ServerProbe", "read_counters"]
