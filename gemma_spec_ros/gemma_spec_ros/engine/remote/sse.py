"""A streamed completion: server-sent events read from one HTTP response, guarded by a watcher.

``POST /v1/completions`` (or ``/v1/chat/completions``) with ``stream: true`` answers with events
``data: {...}`` up to ``data: [DONE]``. :class:`SseReader` splits them as bytes, so a read boundary
never splits a UTF-8 character, and refuses a line longer than :data:`MAX_EVENT_LINE_BYTES`.

:class:`StreamGuard`, a watcher thread, shuts the connected socket down when the goal is cancelled,
when its ``time_budget`` runs out (the stream ends with finish_reason ``timeout`` and its text so
far), or when no ``data:`` event came for ``read_timeout`` (keep-alive comments such as ``: ping``
do not count: a server whose generation hangs while it pings ends the goal with an error); a
blocked read returns at once and the server sees the client gone and stops generating.
"""
from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from .http import CANCEL_POLL, TRANSPORT_ERRORS, CallGuard, HttpClient, RemoteError, describe, error_message

#: Longest line of an event stream: a completion chunk is a few hundred bytes, so a longer line is
#: a broken or hostile server, refused before it holds memory and a core.
MAX_EVENT_LINE_BYTES = 1 << 20
#: Bytes asked of the socket per read.
READ_BYTES = 65536
#: Why a stream's watcher shut its socket down (besides a cancel).
BUDGET, SILENCE = "time budget", "no data within read_timeout"


class SseReader:
    """Server-sent events from an HTTP response: ``data:`` payloads, whole UTF-8 characters.

    >>> import io
    >>> r = SseReader(io.BytesIO(': ping\\r\\ndata: {"a": 1}\\n\\ndata: [DONE]\\n'.encode()).read1)
    >>> list(r)
    ['{"a": 1}', '[DONE]']
    """

    def __init__(self, read1: Callable[[int], bytes]) -> None:
        self._read1 = read1
        # the unfinished last line, as the reads' pieces (joined once, when its newline comes:
        # each byte is searched and copied once, however small the reads); at most
        # MAX_EVENT_LINE_BYTES in all
        self._pending: List[bytes] = []
        self._pending_bytes = 0

    def __iter__(self) -> Iterator[str]:
        while True:
            data = self._read1(READ_BYTES)
            if not data:
                return
            # Lines are split as bytes: a newline byte never occurs inside a UTF-8 sequence, so
            # every line decodes to whole characters.
            for line in self._lines(data):
                text = line.rstrip(b"\r").decode("utf-8", "replace")
                if text.startswith("data:"):
                    yield text[len("data:"):].strip()

    def _lines(self, data: bytes) -> List[bytes]:
        """The lines ``data`` ends (the first one joined with the pending pieces); keeps the rest
        pending. Only ``data`` is searched for newlines."""
        lines = data.split(b"\n")
        rest = lines.pop()
        if lines and self._pending:
            self._pending.append(lines[0])
            lines[0] = b"".join(self._pending)
            self._pending, self._pending_bytes = [], 0
        if rest:
            self._pending.append(rest)
            self._pending_bytes += len(rest)
            if self._pending_bytes > MAX_EVENT_LINE_BYTES:
                raise RemoteError(f"the server sent a line of more than {MAX_EVENT_LINE_BYTES} bytes "
                                  "without an end: not an event stream of completions")
        return lines


class StreamGuard(CallGuard):
    """The watcher of a stream (see :class:`~.http.CallGuard`): its socket is shut down when
    ``cancel`` is set, when the request's time budget ends (``budget_ends``, time.monotonic(); inf
    = none) or when no data event came for ``read_timeout`` (:meth:`saw_data` restarts that clock;
    keep-alive comments keep bytes flowing, so the socket's own timeout never fires). A blocked
    read then returns and the server sees the client gone (it stops generating). ``expired`` says
    which deadline passed."""

    def __init__(self, sock: socket.socket, cancel: threading.Event, read_timeout: float,
                 budget_ends: float) -> None:
        self._read_timeout = read_timeout
        self._silence_ends = time.monotonic() + read_timeout
        super().__init__(sock, cancel, budget_ends)

    def saw_data(self) -> None:
        self._silence_ends = time.monotonic() + self._read_timeout

    def deadline_passed(self, now: float) -> str:
        if self.budget_spent():
            return BUDGET
        return SILENCE if now >= self._silence_ends else ""


class EndedBeforeResponse(Exception):
    """The goal was cancelled, or its time budget ran out, before the server's response arrived."""

    def __init__(self, finish_reason: str) -> None:
        super().__init__(finish_reason)
        self.finish_reason = finish_reason


class Stream:
    """One open event stream: its chunks (:meth:`chunks`), then how it ended (:meth:`outcome`).
    ``started`` is the perf_counter when the request was sent (TTFT counts from there);
    ``server_header`` the response's ``Server`` header ('' without one), which with the first
    chunk (:meth:`first`) tells which server answered (server.py ``ServerMarks``)."""

    def __init__(self, url: str, conn: http.client.HTTPConnection, response: http.client.HTTPResponse,
                 started: float, guard: StreamGuard, cancel: threading.Event) -> None:
        self._url, self._conn, self._response = url, conn, response
        self.started, self.guard, self._cancel = started, guard, cancel
        self.server_header = str(response.getheader("Server") or "")[:200]
        self.events = 0  # data events read ([DONE] excluded)
        self._silent = False  # the socket's own timeout fired: no bytes at all for read_timeout
        self._read = self._read_chunks()
        self._first: List[Dict[str, Any]] = []  # the chunk :meth:`first` read, not yielded yet

    def first(self) -> Optional[Dict[str, Any]]:
        """The first chunk, read now (up to read_timeout, as :meth:`chunks` would) and still the
        first :meth:`chunks` yields (ask before iterating it); None if the stream ended (or was
        cancelled) before one."""
        if not self._first:
            self._first.extend(itertools.islice(self._read, 1))
        return self._first[0] if self._first else None

    def chunks(self) -> Iterator[Dict[str, Any]]:
        """The stream's JSON chunks up to ``[DONE]``, its end, a cancel or a deadline; RemoteError
        if it breaks otherwise or sends something other than completion chunks."""
        if self._first:
            yield self._first.pop()
        yield from self._read

    def _read_chunks(self) -> Iterator[Dict[str, Any]]:
        try:
            for data in SseReader(self._response.read1):
                self.guard.saw_data()
                if data == "[DONE]":
                    return
                self.events += 1
                yield parse_chunk(data)
        except TRANSPORT_ERRORS as exc:
            self._silent = isinstance(exc, socket.timeout)
            if not (self._cancel.is_set() or self.guard.expired or self._silent):
                raise RemoteError(f"stream from {self._url} broke after {self.events} chunks: "
                                  f"{describe(exc)}") from None

    def outcome(self, finish: Optional[str], finish_reasons: Mapping[str, str], read_timeout: float) -> str:
        """The request's finish reason once :meth:`chunks` ended: cancelled, timeout, or the
        server's ``finish`` mapped by ``finish_reasons``; RemoteError for a stuck or cut stream."""
        guard = self.guard
        if self._cancel.is_set():
            return "cancelled"
        if finish is None and (self._silent or guard.expired == SILENCE):
            raise RemoteError(f"no data from {self._url} for remote.read_timeout={read_timeout:g} s "
                              f"after {self.events} chunks (keep-alive comments do not count): the "
                              "server is stuck or overloaded")
        if finish is None and (guard.expired == BUDGET or guard.budget_spent()):
            return "timeout"
        if finish is None:
            raise RemoteError(f"the stream from {self._url} ended without a finish reason after "
                              f"{self.events} chunks (server stopped, or a request of another client "
                              "interrupted it)")
        if finish not in finish_reasons:
            raise RemoteError(f"the server ended the generation with finish_reason {finish!r}")
        return finish_reasons[finish]

    def close(self) -> None:
        self.guard.done.set()
        self._response.close()  # it owns the socket of a stream that ends with the connection
        self._conn.close()


def open_stream(client: HttpClient, path: str, body: Mapping[str, Any], cancel: threading.Event,
                budget_ends: float) -> Stream:
    """Connect, send ``body``, read the status: a stream guarded by a watcher thread from the
    connection on (so a server silent before its first byte is covered too). Raises
    ServerUnreachableError (no connection), EndedBeforeResponse (cancel or budget first) or
    RemoteError (an HTTP error, no answer within read_timeout)."""
    url, read_timeout = client.config.url, client.config.read_timeout
    started = time.perf_counter()
    conn = client.connect(read_timeout)
    guard = StreamGuard(conn.sock, cancel, read_timeout, budget_ends)
    try:
        conn.request("POST", client.base + path, body=json.dumps(body).encode(),
                     headers={**client.headers(), "Accept": "text/event-stream"})
        response = conn.getresponse()
    except TRANSPORT_ERRORS as exc:
        guard.done.set()
        conn.close()
        if cancel.is_set():
            raise EndedBeforeResponse("cancelled") from None
        if guard.expired == BUDGET:
            raise EndedBeforeResponse("timeout") from None
        if guard.expired == SILENCE or isinstance(exc, socket.timeout):
            raise RemoteError(f"no response from {url} within remote.read_timeout={read_timeout:g} s") from None
        raise RemoteError(f"POST {path} on {url}: {describe(exc)}") from None
    if response.status != 200:
        guard.done.set()
        try:
            detail = error_message(response.read(1 << 16))
        except TRANSPORT_ERRORS:
            detail = ""
        conn.close()
        raise RemoteError(f"HTTP {response.status} {response.reason} from POST {path} on {url}"
                          + (f": {detail}" if detail else ""))
    return Stream(url, conn, response, started, guard, cancel)


def parse_chunk(data: str) -> Dict[str, Any]:
    """One event's JSON object; RemoteError for anything else, or for an error the server sent.

    >>> parse_chunk('{"choices": []}')
    {'choices': []}
    """
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RemoteError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"the server sent an unexpected event: {data[:200]!r}")
    if "error" in chunk:
        raise RemoteError(f"the server reported an error mid-stream: {error_message(data.encode())}")
    return chunk


def choice(chunk: Mapping[str, Any]) -> Tuple[str, Optional[str]]:
    """(new text, finish_reason or None) of a completion or chat-completion chunk.

    >>> choice({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]})
    ('Hi', None)
    """
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    first = choices[0] if isinstance(choices, list) else None
    if not isinstance(first, dict):
        raise RemoteError(f"the server sent a chunk whose choices are not objects: {str(choices)[:200]!r}")
    text = first.get("text")
    if text is None:
        delta = first.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
    finish = first.get("finish_reason")
    if not isinstance(text or "", str) or not isinstance(finish, (str, type(None))):
        raise RemoteError(f"the server sent a chunk with a text or finish_reason that is not a string: "
                          f"{str(first)[:200]!r}")
    return text or "", finish


__all__ = ["CANCEL_POLL", "MAX_EVENT_LINE_BYTES", "EndedBeforeResponse", "SseReader", "Stream",
           "StreamGuard", "choice", "open_stream", "parse_chunk"]
