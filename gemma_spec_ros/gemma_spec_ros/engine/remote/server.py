"""What the remote engine knows of its server: reachability (a prober thread), kind, context length,
tokenizer, and the "idle gate" for servers that cannot answer while they stream.

Kinds, told apart by the endpoints they answer: llama.cpp's ``llama-server`` (``/props``), vLLM
(``max_model_len`` in ``/v1/models``), llama-cpp-python's ``llama_cpp.server``
(``/extras/tokenize/count``), else a plain OpenAI-compatible server. llama_cpp.server serves one
request at a time and, by default, a new request interrupts the running stream: it is asked for
anything that needs its model (tokenize, /v1/models) only while the engine is not streaming, and
one such server should serve one robot (or run with ``--interrupt_requests false``).

The kind, n_ctx and model are detected again after the server was unreachable, answered an
error, answered ``/health`` otherwise than before (its fingerprint: a box behind ``remote.url``
may have been replaced by another server meanwhile), or streamed with other marks than before
(:class:`ServerMarks`: a proxy that switches backends keeps ``/health`` as it was, and the swap
may come between two probes): until then they are *stale* (:attr:`ServerProbe.identified` is
False). A constrained request is sent only to a server identified by a probe of the last two probe
periods (one is made first otherwise), and refused rather than sent with another kind's fields,
which that server would ignore (unconstrained text); one whose stream shows another kind of server
than the one its fields were built for is sent again once, after the server is identified anew
(engine.py).
"""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Mapping, Optional, TypeVar

from ..chat.syntax import CallSyntax, syntax_of_template
from .config import RemoteConfig
from .http import HttpClient, RemoteError, server_count
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


@dataclass(frozen=True)
class ServerMarks:
    """What every stream says of the server that sent it, no request added: its ``Server`` header
    (llama-server's is ``llama.cpp``, llama_cpp.server's ``uvicorn``, as vLLM's by default; a proxy
    may put its own) and its first chunk's ``system_fingerprint`` (llama-server's build, e.g.
    ``b6000-1a2b3c``; the stream chunks of vLLM and llama_cpp.server have none) and ``model`` (the
    served model's name or path). Each server's marks are constant from one stream to the next (the
    request's ``model`` is the same every time; checked on llama-server and llama_cpp.server); they
    are compared with those of the first stream of the same path since the server was identified,
    never with a guess of what a kind sends.

    >>> marks = marks_of("llama.cpp", {"model": "m.gguf", "system_fingerprint": "b1-abc"})
    >>> marks.other_kind(marks_of("uvicorn", {"model": "m.gguf"})), marks.other_kind(replace(marks, model="n"))
    (True, False)
    """

    server: str = ""
    fingerprint: str = ""
    model: str = ""

    def other_kind(self, other: "ServerMarks") -> bool:
        """Whether ``other`` comes from another kind of server: what tells kinds apart (the header;
        a fingerprint or none) differs, not only a build or a model (a balancer over several
        servers of one kind)."""
        return self.server != other.server or bool(self.fingerprint) != bool(other.fingerprint)


def marks_of(server_header: str, chunk: Mapping[str, Any]) -> ServerMarks:
    """The marks of a stream from its ``Server`` header and first chunk (a field that is not a
    string counts as absent)."""
    def text(key: str) -> str:
        value = chunk.get(key)
        return value[:200] if isinstance(value, str) else ""
    return ServerMarks(server_header, text("system_fingerprint"), text("model"))


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

    def __init__(self, client: HttpClient, config: RemoteConfig, busy: Any,
                 tau: TauAttribution) -> None:
        self._client, self._config, self._busy, self._tau = client, config, busy, tau
        self._lock = threading.Lock()
        self._last = ProbeResult()
        self.kind = ""  # which server (detected once reachable); '' = not yet known
        self.n_ctx = 0  # as the server reports it; 0 = unknown
        self.model = ""  # the server's model id, '' if it names none
        #: the call syntax of a llama-server's chat template (None: unknown or neither)
        self.call_syntax: Optional[CallSyntax] = None
        self.tokenizer = "estimate"  # what counted the last request's prompt
        # kind/n_ctx/model not detected since the server last failed (or ever): detect again
        self._stale = True
        self._identified_by: Optional[tuple] = None  # the /health answer (status, body start) at detection
        self._marks: Dict[str, ServerMarks] = {}  # per path, the first stream's marks since detection
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

    @property
    def identified(self) -> bool:
        """True if the kind was detected since the server last failed (a fresh kind)."""
        return bool(self.kind) and not self._stale

    def recently_probed(self) -> bool:
        """True if the running prober probed within its last two periods (False without one)."""
        if self._thread is None:
            return False
        return time.monotonic() - self.last.checked_at <= 2 * self._config.probe_period

    def forget_identity(self) -> None:
        """The server was unreachable or answered an error: detect its kind and n_ctx again at the
        next probe that finds it answering (the values stay, marked stale, until then)."""
        self._stale = True

    def same_server(self, path: str, marks: ServerMarks) -> bool:
        """Whether a stream of ``path`` with ``marks`` comes from the kind of server identified. The
        first stream of each path since the detection teaches its marks; a later one with other
        marks makes the kind, n_ctx and model stale (detected again by the next probe, or before
        the next request that needs them: no request is added here). False only when the marks
        show another kind (:meth:`ServerMarks.other_kind`): a request built for the kind cached
        may carry fields this server ignores."""
        with self._lock:
            known = self._marks.setdefault(path, marks)
        if known == marks:
            return True
        self.forget_identity()
        return not known.other_kind(marks)

    def probe(self) -> bool:
        """GET /health once: reachability and round-trip time (any HTTP answer counts: llama_cpp.server
        has no /health and answers 404 without touching its model lock). Detects the server's kind
        when it is not freshly known and reads /metrics. Returns reachability."""
        started = time.perf_counter()
        try:
            status, body = self._client.get("/health")
        except RemoteError as exc:
            self.mark(False, math.nan, str(exc))
            self.forget_identity()
            return False
        self.mark(True, time.perf_counter() - started, "" if status < 500 else f"/health: HTTP {status}")
        fingerprint = (status, bytes(body[:256]))
        if status >= 500:  # llama-server answers 503 while it loads the model
            self.forget_identity()
        elif not self.identified or fingerprint != self._identified_by:
            self.forget_identity()
            self.when_idle(lambda: self._detect(fingerprint))
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

    def count_tokens(self, text: str, timeout: float, cancel: Optional[threading.Event] = None) -> Optional[int]:
        """``text``'s tokens by the server's tokenizer, asked within ``timeout`` or until ``cancel``;
        None if it has none or did not answer. RemoteError if it answers a count that is none."""
        kind = "" if self.last.reachable is False else self.kind  # no wait on a server found down

        def post(path: str, body: Any) -> Optional[Any]:
            return self._client.post_json(path, body, timeout, cancel)
        reply: Optional[Any] = None
        count = None
        if kind == KIND_LLAMA_SERVER:
            reply = post("/tokenize", {"content": text, "add_special": True})
            tokens = reply.get("tokens") if isinstance(reply, dict) else None
            if tokens is not None and not isinstance(tokens, list):
                raise RemoteError(f"the server's /tokenize answered tokens as {type(tokens).__name__}, not a list")
            count = len(tokens) if tokens is not None else None
        elif kind == KIND_VLLM:
            body = {"prompt": text, **({"model": self._config.model} if self._config.model else {})}
            reply = post("/tokenize", body)
            count = reply.get("count") if isinstance(reply, dict) else None
        elif kind == KIND_LLAMA_CPP_PYTHON:
            reply = self.when_idle(lambda: post("/extras/tokenize/count", {"input": text}))
            count = reply.get("count") if isinstance(reply, dict) else None
        self.tokenizer = f"{kind} tokenizer" if count is not None else "estimate"
        return server_count(count, "the prompt's token count") if count is not None else None

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

    def _detect(self, fingerprint: tuple) -> None:
        """Which server this is, from the endpoints it answers; its n_ctx and /metrics.
        ``fingerprint`` is the /health answer it is known by from now on. A server that stops
        answering meanwhile leaves the kind stale (detected at a later probe)."""
        try:
            props, models = self._answer("/props"), self._answer("/v1/models")
        except RemoteError:
            return
        kind, n_ctx, syntax = KIND_OPENAI, 0, None
        data = models.get("data") if isinstance(models, dict) else None
        entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        if isinstance(props, dict) and "default_generation_settings" in props:
            kind = KIND_LLAMA_SERVER
            settings = props.get("default_generation_settings")
            settings = settings if isinstance(settings, dict) else {}
            n_ctx = _context_length(settings.get("n_ctx") or props.get("n_ctx"))
            template = props.get("chat_template")
            syntax = syntax_of_template(template) if isinstance(template, str) else None
        elif "max_model_len" in entry:
            kind = KIND_VLLM
            n_ctx = _context_length(entry.get("max_model_len"))
        elif self._client.post_json("/extras/tokenize/count", {"input": "a"}, self._config.connect_timeout):
            kind = KIND_LLAMA_CPP_PYTHON
        self.n_ctx, self.model, self.call_syntax = n_ctx, str(entry.get("id") or "")[:200], syntax
        self.kind, self._identified_by = kind, fingerprint
        with self._lock:
            self._marks = {}  # the next streams teach this server's marks
        self._stale = False
        self._tau.available = (kind in (KIND_LLAMA_SERVER, KIND_VLLM)
                               and read_counters(self._client) is not None)

    def _answer(self, path: str) -> Optional[Any]:
        """The JSON of a 200 answer to GET ``path``; None for another answer or a body that is not
        JSON; RemoteError if the server did not answer."""
        status, body = self._client.get(path)
        try:
            return json.loads(body) if status == 200 else None
        except ValueError:
            return None


def _context_length(value: Any) -> int:
    """The server's reported context length; 0 (unknown: no goal check against it) for a value
    that is not a count."""
    try:
        return server_count(value, "n_ctx") if value is not None else 0
    except RemoteError:
        return 0


__all__ = ["KIND_LLAMA_CPP_PYTHON", "KIND_LLAMA_SERVER", "KIND_OPENAI", "KIND_VLLM", "LLAMA_CPP_KINDS",
           "ProbeResult", "ServerMarks", "ServerProbe", "marks_of", "read_counters"]
