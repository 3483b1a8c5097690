#!/usr/bin/env python3
"""Same-run measurement of the remote backend's HTTP client choices against a real llama-server.

Whether the hand-written client (``http.client`` + a byte line splitter + cancel by socket shutdown)
or httpx (+ httpx-sse) should carry the remote backend (docs/deployment.md has the figures). Both
stream the same completions from one llama-server, interleaved round by round, and the script
prints, per client:

- client CPU per streamed event (``time.thread_time`` of the reading thread / events): what the
  client costs per token, independent of how fast the server generates;
- wall time per event (the server's pace plus the client's);
- cancel latency: a stream whose server is frozen (SIGSTOP, so the read blocks) is cancelled from
  another thread; the time from the cancel to the reading loop's end. httpx is measured twice: by
  ``response.close()`` from the other thread, and by shutting down the socket it connected (taken
  from httpcore's ``network_stream`` extension), as the hand-written client does.

Usage: bench_remote_client.py [--server PATH] [--model GGUF] [--rounds 5] [--tokens 200]
(run it under ``flock /tmp/gemma-bench.lock`` on a shared machine). It needs httpx and httpx-sse,
which the project itself does not use: ``.venv/bin/python -m pip install httpx httpx-sse``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import httpx
import httpx_sse

CACHE = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def lines(read: Callable[[], bytes]) -> Iterator[bytes]:
    """``data:`` payloads split as bytes, as the engine's reader does."""
    tail = b""
    while True:
        data = read()
        if not data:
            return
        *got, tail = (tail + data).split(b"\n")
        for line in got:
            if line.startswith(b"data:"):
                yield line[5:].strip()


def body(tokens: int) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def stream_stdlib(port: int, tokens: int, on_open: Callable[[socket.socket, object], None]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    sock = conn.sock
    conn.request("POST", "/v1/completions", body=body(tokens),
                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    response = conn.getresponse()
    on_open(sock, response)
    events = 0
    try:
        for data in lines(lambda: response.read1(65536)):
            if data == b"[DONE]":
                break
            json.loads(data)
            events += 1
    except (OSError, http.client.HTTPException):  # the cancel's shutdown cuts the stream
        pass
    finally:
        response.close()
        conn.close()
    return events


def stream_httpx(client: httpx.Client, tokens: int, sse: bool,
                 on_open: Callable[[socket.socket, object], None]) -> int:
    events = 0
    request = client.build_request("POST", "/v1/completions", content=body(tokens),
                                   headers={"Content-Type": "application/json",
                                            "Accept": "text/event-stream"})
    response = client.send(request, stream=True)
    try:
        on_open(response.extensions["network_stream"].get_extra_info("socket"), response)
        if sse:
            for event in httpx_sse.EventSource(response).iter_sse():
                if event.data == "[DONE]":
                    break
                json.loads(event.data)
                events += 1
        else:
            for data in lines(lambda it=response.iter_raw(65536): next(it, b"")):
                if data == b"[DONE]":
                    break
                json.loads(data)
                events += 1
    except (httpx.HTTPError, OSError):
        pass
    finally:
        response.close()
    return events


def timed(run: Callable[[], int]) -> Tuple[float, float, int]:
    """(client CPU s per event, wall s per event, events) of one stream read in this thread."""
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    events = run()
    return ((time.thread_time() - cpu0) / max(1, events), (time.perf_counter() - wall0) / max(1, events),
            events)


def cancel_latency(server: subprocess.Popen, run: Callable[[Callable], int], how: str) -> float:
    """Seconds from the cancel to the end of a stream blocked on a frozen server."""
    cancelled_at: List[float] = []

    def on_open(sock: socket.socket, response: object) -> None:
        os.kill(server.pid, signal.SIGSTOP)  # the next read blocks

        def cancel() -> None:
            cancelled_at.append(time.perf_counter())
            if how == "shutdown":
                sock.shutdown(socket.SHUT_RDWR)
            else:
                response.close()  # type: ignore[attr-defined]
        threading.Timer(0.3, cancel).start()

    try:
        result: List[int] = []
        reader = threading.Thread(target=lambda: result.append(run(on_open)), daemon=True)
        reader.start()
        reader.join(10.0)
        ended = time.perf_counter()
        return ended - cancelled_at[0] if not reader.is_alive() else float("inf")
    finally:
        os.kill(server.pid, signal.SIGCONT)
        time.sleep(0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=str(CACHE / "native" / "bin" / "llama-server"))
    parser.add_argument("--model", default=str(CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([args.server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                               "-t", "1", "-tb", "1", "-c", "1024", "-np", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(60, connect=2))
        nothing = lambda sock, response: None  # noqa: E731
        clients: Dict[str, Callable[[Callable], int]] = {
            "http.client (hand-written)": lambda cb: stream_stdlib(port, args.tokens, cb),
            "httpx iter_raw + own splitter": lambda cb: stream_httpx(client, args.tokens, False, cb),
            "httpx + httpx-sse iter_sse": lambda cb: stream_httpx(client, args.tokens, True, cb),
        }
        for run in clients.values():  # warm-up: the server's prompt cache, imports, connections
            run(nothing)
        figures: Dict[str, List[Tuple[float, float, int]]] = {name: [] for name in clients}
        for _ in range(args.rounds):
            for name, run in clients.items():
                figures[name].append(timed(lambda: run(nothing)))
        print(f"{args.rounds} rounds x {args.tokens} tokens, llama-server on {Path(args.model).name}")
        print(f"{'client':32} {'CPU us/event (median, min-max)':34} {'wall ms/event':14} events")
        for name, rows in figures.items():
            cpu = [r[0] * 1e6 for r in rows]
            wall = [r[1] * 1e3 for r in rows]
            print(f"{name:32} {statistics.median(cpu):7.1f} ({min(cpu):.1f}-{max(cpu):.1f}){'':14} "
                  f"{statistics.median(wall):8.3f}       {rows[0][2]}")
        print("cancel latency of a read blocked on a frozen server (ms, median of 3):")
        cases = [("http.client, socket shutdown", clients["http.client (hand-written)"], "shutdown"),
                 ("httpx, socket shutdown", clients["httpx iter_raw + own splitter"], "shutdown"),
                 ("httpx, response.close()", clients["httpx iter_raw + own splitter"], "close")]
        for label, run, how in cases:
            lat = [cancel_latency(server, lambda cb: run(cb), how) * 1e3 for _ in range(3)]
            print(f"  {label:32} {statistics.median(lat):9.2f}   {['%.2f' % x for x in lat]}")
        client.close()
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=15)


if __name__ == "__main__":
    main()
