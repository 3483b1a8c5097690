"""RemoteEngine against stream shapes no real server produces on demand, served by
:class:`support.servers.ScriptedStreamServer` (a fake, on loopback): a generation that hangs while
keep-alive comments flow, a stream without chunked encoding that a cancel must still end at once, a
line with no end. The same engine paths against real servers are in test/remote/test_engine.py.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, List

import pytest

from gemma_spec_ros.engine.engine import Step
from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine, RemoteError
from gemma_spec_ros.engine.remote.sse import MAX_EVENT_LINE_BYTES, SseReader
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import SpecConfig
from support.servers import SSE_CHUNKED_HEAD, SSE_CLOSE_DELIMITED_HEAD, ScriptedStreamServer, chunk

TOKEN_EVENT = b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
#: How long a script keeps the stream open at most: far beyond every bound the tests assert, so a
#: stream that the engine does not end itself shows as a failed bound, not as a hung test.
SCRIPT_SECONDS = 15.0


@pytest.fixture
def engine_for() -> Iterator[Callable[..., RemoteEngine]]:
    """``engine_for(server, read_timeout)``: an engine on a scripted server, closed afterwards."""
    engines: List[RemoteEngine] = []

    def make(server: ScriptedStreamServer, read_timeout: float) -> RemoteEngine:
        engines.append(RemoteEngine(RemoteConfig(url=server.url, connect_timeout=1.0,
                                                 read_timeout=read_timeout, probe_period=0),
                                    SpecConfig(mode="off")))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def keep_alive_only(send: Callable[[bytes], bool]) -> None:
    """A chunked event stream that sends ``: ping`` every 0.1 s and never a data event."""
    send(SSE_CHUNKED_HEAD)
    deadline = time.monotonic() + SCRIPT_SECONDS
    while time.monotonic() < deadline and send(chunk(b": ping\n\n")):
        time.sleep(0.1)


def one_token_then_keep_alive(send: Callable[[bytes], bool]) -> None:
    send(SSE_CHUNKED_HEAD + chunk(TOKEN_EVENT))
    keep_alive_only(lambda data: send(data) if not data.startswith(b"HTTP/") else True)


def silent_after_the_head(send: Callable[[bytes], bool]) -> None:
    send(SSE_CHUNKED_HEAD)
    time.sleep(SCRIPT_SECONDS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script, chunks", [(keep_alive_only, 0), (one_token_then_keep_alive, 1),
                                            (silent_after_the_head, 0)])
def test_keep_alive_comments_do_not_hold_a_stuck_stream(engine_for, script, chunks: int) -> None:
    """A stream with no data event for read_timeout ends with an error that says so, whether
    keep-alive comments flow (before: never, as long as the pings came) or nothing does; the text
    streamed before stays with the goal."""
    with ScriptedStreamServer(script) as server:
        engine = engine_for(server, read_timeout=1.0)
        steps: List[Step] = []
        started = time.monotonic()
        with pytest.raises(RemoteError, match=r"no data .* remote\.read_timeout=1 s .*keep-alive"):
            for step in engine.generate(GenerationRequest(prompt="Hi", max_tokens=8)):
                steps.append(step)
        assert time.monotonic() - started < 6.0
        assert [s.text for s in steps] == ["a"] * chunks


def one_token_then_silent_close_delimited(send: Callable[[bytes], bool]) -> None:
    """A stream that ends with the connection (no chunked encoding): one token, then silence."""
    send(SSE_CLOSE_DELIMITED_HEAD + TOKEN_EVENT)
    time.sleep(SCRIPT_SECONDS)


@pytest.mark.timeout(60)
def test_cancel_ends_a_stream_without_chunked_encoding_at_once(engine_for) -> None:
    """http.client hands such a stream's socket to the response (conn.sock is then None): the
    watcher shuts down the socket it connected, so cancel does not wait for read_timeout."""
    with ScriptedStreamServer(one_token_then_silent_close_delimited) as server:
        engine = engine_for(server, read_timeout=10.0)
        cancel = threading.Event()
        steps = []
        for step in engine.generate(GenerationRequest(prompt="Hi", max_tokens=8), cancel):
            steps.append(step)
            if step.text:  # cancel from another thread while the next read waits, as the node does
                cancel_at = time.monotonic() + 0.3
                threading.Timer(0.3, cancel.set).start()
        assert steps[-1].finish_reason == "cancelled" and steps[0].text == "a"
        assert time.monotonic() - cancel_at < 3.0, "cancel waited for the read timeout"


def endless_line(send: Callable[[bytes], bool]) -> None:
    """A data line that never ends (8 MiB, then the connection closes)."""
    if send(SSE_CLOSE_DELIMITED_HEAD + b'data: {"choices": [{"text": "'):
        block = b"x" * 65536
        for _ in range(128):
            if not send(block):
                return


@pytest.mark.timeout(60)
def test_a_line_without_an_end_is_refused_at_the_cap(engine_for) -> None:
    with ScriptedStreamServer(endless_line) as server:
        engine = engine_for(server, read_timeout=10.0)
        with pytest.raises(RemoteError, match="line of more than 1048576 bytes without an end"):
            list(engine.generate(GenerationRequest(prompt="Hi", max_tokens=8)))


def test_the_event_reader_stops_reading_at_the_line_cap() -> None:
    """The reader refuses the line once it passes the cap: it has read at most one more block, and
    holds the tail as bytes (no text re-decoded or rescanned per read: linear time)."""
    reads = 0

    def read1(size: int) -> bytes:
        nonlocal reads
        reads += 1
        return b"data: " if reads == 1 else (b"x" * size if reads <= 64 else b"")

    with pytest.raises(RemoteError, match="without an end"):
        list(SseReader(read1))
    assert (reads - 1) * 65536 <= MAX_EVENT_LINE_BYTES + 65536
