"""The remote engine's HTTP transport: one connection per call (standard library ``http.client``),
the API key header, and the text of an error.

Why not httpx or the openai client: scripts/bench_remote_client.py measured both against a real
llama-server (docs/deployment.md, "Remote client"). Neither interrupts a read blocked on a hung
server from another thread by its own means, neither caps an event line, and neither tells a data
event from a keep-alive comment, so the stream's watcher (remote/sse.py) would stay as it is; the
library would only replace this file, at a higher client cost per streamed token.
"""
from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import EngineError
from .config import RemoteConfig

#: The most bytes read of a plain (not streamed) answer: tokenizer replies, /metrics, /props.
MAX_BODY_BYTES = 1 << 22
#: Exceptions of a failed connection, request or read.
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)
#: Seconds between two checks of the cancel event and the deadline by a call's watcher thread.
CANCEL_POLL = 0.02
#: Why a watcher shut its socket down (besides a cancel): the call's (or request's) deadline.
DEADLINE = "deadline"
#: The largest count a server may report (the node's result fields are uint32).
MAX_COUNT = 2**32 - 1


class RemoteError(EngineError):
    """The server answered with an error, timed out, or went away mid-stream."""


class ServerUnreachableError(RemoteError):
    """No connection could be made (refused, no route, connect timeout): the fallback may serve."""


class CallGuard:
    """A watcher thread that shuts a connection's socket down when ``cancel`` is set or when
    ``ends`` (time.monotonic()) passes, so that a read blocked on a hung or trickling server
    returns at once: a socket timeout bounds one read, not a call. ``expired`` says which deadline
    passed ('' for none or a cancel). Set ``done`` when the call is over: the thread exits.

    The socket is the one the connection made: http.client sets ``conn.sock`` to None once a
    response that ends with the connection (no chunked encoding) owns it."""

    def __init__(self, sock: socket.socket, cancel: Optional[threading.Event], ends: float) -> None:
        self._sock, self._cancel, self._ends = sock, cancel or threading.Event(), ends
        self.expired = ""
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="gemma_spec_remote_watch").start()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def budget_spent(self) -> bool:
        return time.monotonic() >= self._ends

    def deadline_passed(self, now: float) -> str:
        """Which deadline has passed at ``now`` ('' = none); subclasses add their own."""
        return DEADLINE if now >= self._ends else ""

    def _watch(self) -> None:
        while not self.done.is_set():
            if self._cancel.wait(CANCEL_POLL):
                break
            self.expired = self.deadline_passed(time.monotonic())
            if self.expired:
                break
        if not self.done.is_set():
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass


def server_count(value: Any, what: str) -> int:
    """A count the server reported (tokens, context length) as an int; RemoteError if it is not a
    whole number in [0, :data:`MAX_COUNT`]. The one check of every number a server sends, so a
    hostile or broken server ends the request with a reason, never an internal error.

    >>> server_count(12, "usage.completion_tokens"), server_count(12.0, "n_ctx")
    (12, 12)
    >>> server_count(-1, "usage.completion_tokens")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gemma_spec_ros.engine.remote.http.RemoteError: the server reported usage.completion_tokens=-1: not a count ...
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise RemoteError(f"the server reported {what}={str(value)[:40]}: not a count (a whole number >= 0)")
    return value


def server_seconds(value: Any, what: str, scale: float = 1.0) -> float:
    """A duration the server reported, times ``scale`` (1e-3 for milliseconds); RemoteError if it
    is not a finite number >= 0.

    >>> server_seconds(250, "timings.prompt_ms", 1e-3)
    0.25
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise RemoteError(f"the server reported {what}={str(value)[:40]}: not a duration (a number >= 0)")
    return float(value) * scale


class HttpClient:
    """Requests to the server at ``config.url`` (a trailing ``/v1`` is dropped: paths name it)."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        parts = urllib.parse.urlsplit(config.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        base = parts.path.rstrip("/")
        self.base = base[:-len("/v1")] if base.endswith("/v1") else base

    def headers(self) -> Dict[str, str]:
        """JSON headers, with the API key read now (a rotated key works at the next request)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.config.api_key_env:
            key = os.environ.get(self.config.api_key_env, "")
            if key:
                headers["Authorization"] = f"Bearer {key}"
        return headers

    def connect(self, read_timeout: float) -> http.client.HTTPConnection:
        """A connected HTTP(S) connection whose reads time out after ``read_timeout`` seconds;
        ServerUnreachableError if none can be made within ``connect_timeout``."""
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.config.connect_timeout)
        try:
            conn.connect()
        except TRANSPORT_ERRORS as exc:
            conn.close()
            raise ServerUnreachableError(f"cannot connect to {self.config.url}: {describe(exc)}") from None
        if conn.sock is not None:
            conn.sock.settimeout(read_timeout)
        return conn

    def call(self, method: str, path: str, body: Optional[bytes], timeout: float,
             cancel: Optional[threading.Event] = None) -> Tuple[int, bytes]:
        """(status, body) of one request, whole within ``timeout`` seconds (connect, send, read:
        a server trickling its answer a byte at a time is cut there) or until ``cancel`` is set;
        RemoteError if it could not be made, read, or finished in time."""
        ends = time.monotonic() + timeout
        conn = self.connect(timeout)
        guard = CallGuard(conn.sock, cancel, ends)
        try:
            conn.request(method, self.base + path, body=body, headers=self.headers())
            response = conn.getresponse()
            answer = response.read(MAX_BODY_BYTES)
            guard.done.set()
            failure = None
        except TRANSPORT_ERRORS as exc:
            guard.done.set()
            answer, failure = b"", describe(exc)
        finally:
            conn.close()
        # a socket the guard shut down reads as the end of the answer: cut, not whole
        if guard.cancelled() or guard.expired or failure is not None:
            why = ("cancelled" if guard.cancelled() else
                   f"no whole answer within {timeout:g} s" if guard.expired else failure)
            raise RemoteError(f"{method} {path} on {self.config.url}: {why}")
        return response.status, answer

    def get(self, path: str) -> Tuple[int, bytes]:
        """GET ``path``, whole within ``connect_timeout`` (probes, /props, /metrics)."""
        return self.call("GET", path, None, self.config.connect_timeout)

    def post_json(self, path: str, payload: Mapping[str, Any], timeout: float,
                  cancel: Optional[threading.Event] = None) -> Optional[Any]:
        """The JSON of a 200 answer to ``payload`` within ``timeout`` (see :meth:`call`); None on
        any other answer, failure, or a cancel."""
        try:
            status, body = self.call("POST", path, json.dumps(payload).encode(), timeout, cancel)
            return json.loads(body) if status == 200 else None
        except (RemoteError, ValueError):
            return None


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style / FastAPI error body, else its start.

    >>> error_message(b'{"error": {"message": "bad key", "code": 401}}')
    'bad key'
    >>> error_message(b'{"detail": "Not Found"}')
    'Not Found'
    """
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("data:"):
        text = text[len("data:"):].strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data))
        if isinstance(error, dict):
            return str(error.get("message") or error)[:300]
        return str(error)[:300]
    return text[:300]


def describe(exc: BaseException) -> str:
    """A transport error in words."""
    if isinstance(exc, socket.timeout):
        return "timed out"
    return str(exc) or type(exc).__name__


__all__ = ["CANCEL_POLL", "CallGuard", "DEADLINE", "HttpClient", "MAX_BODY_BYTES", "MAX_COUNT", "RemoteError",
           "ServerUnreachableError", "TRANSPORT_ERRORS", "describe", "error_message", "server_count",
           "server_seconds"]
