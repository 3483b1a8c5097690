"""Real inference servers on loopback for the remote-backend tests: llama-cpp-python's own
OpenAI-compatible server (``python -m llama_cpp.server``, its ``server`` extra installed by
scripts/setup.sh) and llama.cpp's ``llama-server`` (scripts/build_native_tools.sh); and
:class:`ScriptedStreamServer`, a fake for the stream shapes no real server produces on demand
(keep-alive comments with no data, no chunked encoding, a line with no end). No test functions
live here.

Every server binds 127.0.0.1 only, on a free port, with one thread: the test machine is shared.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple

import pytest

#: Where scripts/build_native_tools.sh installs llama.cpp's binaries.
NATIVE_BIN = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros") / "native" / "bin"
LLAMA_SERVER = NATIVE_BIN / "llama-server"
#: The API key the llama_cpp.server fixture requires, and the variable the engine reads it from.
API_KEY = "test-key-not-secret"
API_KEY_ENV = "GEMMA_SPEC_TEST_API_KEY"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def missing_server_extra() -> str:
    """'' if llama_cpp.server can start, else what is missing."""
    try:
        import fastapi, pydantic_settings, sse_starlette, starlette_context, uvicorn  # noqa: F401,E401
    except ImportError as exc:
        return f"llama-cpp-python's server extra is not installed ({exc}): run `make setup`"
    return ""


class Server:
    """A server process on 127.0.0.1:``port``; ``start`` waits until it answers HTTP."""

    def __init__(self, argv: List[str], port: int, log_path: Path, name: str) -> None:
        self.argv, self.port, self.log_path, self.name = argv, port, log_path, name
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "Server":
        env = {**os.environ, "OMP_WAIT_POLICY": "passive", "PYTHONUNBUFFERED": "1"}  # logs read live
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if self._answers():
                return self
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s; see {self.log_path}")

    def _answers(self) -> bool:
        """Any HTTP answer to GET /health but 503 (llama-server's 'loading model')."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2.0)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status != 503
        except OSError:
            return False
        finally:
            conn.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would (no graceful shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP for the duration: a hung server (the kernel still accepts connections, nothing
        answers), then SIGCONT."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def llama_cpp_server(model: Path, log_dir: Path, port: int = 0, api_key: str = API_KEY,
                     n_ctx: int = 1024) -> Server:
    """llama-cpp-python's server on the embedded model (not started)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", str(n_ctx),
            # its default computes logits for every prompt row (3x slower prompts, n_ctx x n_vocab floats)
            "--logits_all", "False"]
    if api_key:
        argv += ["--api_key", api_key]
    return Server(argv, port, log_dir / f"llama_cpp_server_{port}.log", "llama_cpp.server")


def llama_server(model: Path, log_dir: Path, extra: List[str], port: int = 0) -> Server:
    """llama.cpp's llama-server with /metrics on (not started); ``extra``: its speculation flags."""
    port = port or free_port()
    argv = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "-tb", "1", "-c", "1024", "-np", "1", "--metrics", *extra]
    return Server(argv, port, log_dir / f"llama_server_{port}.log", "llama-server")


def running_llama_cpp_server(model: Path, log_dir: Path) -> Iterator[Server]:
    """For a module fixture: llama_cpp.server on ``model``, requiring :data:`API_KEY`, started
    (a missing ``server`` extra fails the test: the setup installs it), stopped afterwards."""
    missing = missing_server_extra()
    if missing:
        pytest.fail(missing)
    server = llama_cpp_server(model, log_dir).start()
    try:
        yield server
    finally:
        server.stop()


#: A script of :class:`ScriptedStreamServer`: writes the raw response with ``send`` (False once the
#: client is gone).
Script = Callable[[Callable[[bytes], bool]], None]


class ScriptedStreamServer:
    """A fake OpenAI-compatible server on 127.0.0.1 whose ``POST /v1/completions`` answer is
    ``script(send)``: the raw bytes of the response, status line and headers included, written with
    ``send`` (False once the client is gone). ``routes`` maps other requests (``"GET /props"``,
    ``"POST /tokenize"``) to scripts of their own; every other request gets an empty 404, so
    without routes the engine sees a plain OpenAI-compatible server. ``port`` 0 = a free one; a
    given port is reused (a server "replaced" at the same address). Each request's line and body are
    kept in ``requests``. A fake, for what no real server does on demand: a generation that hangs
    while keep-alive comments flow (sse-starlette pings every 15 s), a stream without chunked
    encoding (HTTP/1.0 proxies, ``Connection: close`` servers), a line with no end, an answer that
    trickles, a server of another kind behind the same address, hostile numbers."""

    def __init__(self, script: Script, routes: Optional[Mapping[str, Script]] = None, port: int = 0) -> None:
        outer = self
        self.requests: List[Tuple[str, bytes]] = []
        routes = {"POST /v1/completions": script, **(routes or {})}

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                line, body = outer._read_request(self.request)
                outer.requests.append((line, body))
                method, _, rest = line.partition(" ")
                path = rest.split(" ", 1)[0].split("?", 1)[0]
                route = routes.get(f"{method} {path}")
                if route is not None:
                    route(lambda data: outer._send(self.request, data))
                else:
                    outer._send(self.request, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "ScriptedStreamServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def bodies(self, request_line_start: str) -> List[bytes]:
        """The bodies of the requests whose line starts with ``request_line_start``."""
        return [body for line, body in self.requests if line.startswith(request_line_start)]

    @staticmethod
    def _read_request(sock: socket.socket) -> Tuple[str, bytes]:
        """The request line and the body (by Content-Length) of one request."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data.split(b"\r\n", 1)[0].decode("latin-1"), b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return head.split(b"\r\n", 1)[0].decode("latin-1"), body

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> bool:
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False


def json_answer(payload: Any, status: str = "200 OK") -> Script:
    """A script answering ``payload`` as JSON (``payload`` bytes: sent as they are)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

    def answer(send: Callable[[bytes], bool]) -> None:
        send(head + body)
    return answer


#: Response heads of :class:`ScriptedStreamServer` scripts: chunked (as llama-server, vLLM), and
#: ended by closing the connection (no length, no chunked encoding).
SSE_CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
SSE_CLOSE_DELIMITED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def chunk(payload: bytes) -> bytes:
    """``payload`` as one HTTP chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)
