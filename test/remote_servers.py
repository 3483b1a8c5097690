"""Real inference servers on loopback for the remote-backend tests: llama-cpp-python's own
OpenAI-compatible server (``python -m llama_cpp.server``, its ``server`` extra installed by
scripts/setup.sh) and llama.cpp's ``llama-server`` (scripts/build_native_tools.sh). No test
functions live here.

Every server binds 127.0.0.1 only, on a free port, with one thread: the test machine is shared.
"""
from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

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
