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
import os
import socket
import urllib.parse
from typing import Any, Dict, Mapping, Optional, Tuple

from ..types import EngineError, RemoteConfig

#: The most bytes read of a plain (not streamed) answer: tokenizer replies, /metrics, /props.
MAX_BODY_BYTES = 1 << 22
#: Exceptions of a failed connection, request or read.
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class RemoteError(EngineError):
    """The server answered with an error, timed out, or went away mid-stream."""


class ServerUnreachableError(RemoteError):
    """No connection could be made (refused, no route, connect timeout): the fallback may serve."""


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

    def call(self, method: str, path: str, body: Optional[bytes], timeout: float) -> Tuple[int, bytes]:
        """(status, body) of one request; RemoteError if it could not be made or read."""
        conn = self.connect(timeout)
        try:
            conn.request(method, self.base + path, body=body, headers=self.headers())
            response = conn.getresponse()
            return response.status, response.read(MAX_BODY_BYTES)
        except TRANSPORT_ERRORS as exc:
            raise RemoteError(f"{method} {path} on {self.config.url}: {describe(exc)}") from None
        finally:
            conn.close()

    def get(self, path: str) -> Tuple[int, bytes]:
        return self.call("GET", path, None, self.config.connect_timeout)

    def get_json(self, path: str) -> Optional[Any]:
        """The JSON of a 200 answer; None on any other answer or failure."""
        try:
            status, body = self.get(path)
            return json.loads(body) if status == 200 else None
        except (RemoteError, ValueError):
            return None

    def post_json(self, path: str, payload: Mapping[str, Any], timeout: float) -> Optional[Any]:
        """The JSON of a 200 answer to ``payload``; None on any other answer or failure."""
        try:
            status, body = self.call("POST", path, json.dumps(payload).encode(), timeout)
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


__all__ = ["HttpClient", "MAX_BODY_BYTES", "RemoteError", "ServerUnreachableError", "TRANSPORT_ERRORS",
           "describe", "error_message"]
