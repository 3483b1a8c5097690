"""The soak's remote phase (``gemma-spec-soak --remote-phase SECONDS``): a real ``llama-server`` on
loopback, frozen with SIGSTOP and resumed while the goals keep coming.

At its turn among the lifecycle cycles, the phase starts llama-server (127.0.0.1, a free port, the
node's own ``target.model_path``), reconfigures the node (cleanup, ``backend: remote`` pointed at it,
configure, activate) and lets the clients send goals with a ``time_budget`` (``--remote-budget``;
``remote.read_timeout`` is half of it). Halfway it freezes the server for ``--freeze`` seconds
(SIGSTOP: the kernel still accepts connections, nothing answers, as a hung server), resumes it
(SIGCONT), and at the end goes back to ``backend: local`` and stops the server.

Checks: every goal alive during the freeze got its result (timeout, error or cancelled are all fine)
within its budget + :data:`FREEZE_MARGIN`; goals sent after the resume succeed again.
"""
from __future__ import annotations

import argparse
import http.client
import math
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

#: Where scripts/build_native_tools.sh installs llama-server.
DEFAULT_LLAMA_SERVER = (Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")
                        / "native" / "bin" / "llama-server")
#: Seconds a goal alive during the freeze may take beyond its time budget: result delivery, and the
#: calls bounded by remote.connect_timeout rather than by the budget (connecting, a tokenizer call).
FREEZE_MARGIN = 5.0
#: remote.connect_timeout during the phase.
CONNECT_TIMEOUT = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote-phase", type=float, default=0.0, metavar="SECONDS",
                        help="a phase of this length with backend remote on a real llama-server, "
                             "frozen (SIGSTOP) for --freeze seconds halfway; 0 = none")
    parser.add_argument("--llama-server", default=str(DEFAULT_LLAMA_SERVER), metavar="PATH",
                        help="llama.cpp's llama-server (scripts/build_native_tools.sh)")
    parser.add_argument("--freeze", type=float, default=10.0, metavar="SECONDS",
                        help="how long the remote phase keeps llama-server stopped")
    parser.add_argument("--remote-budget", type=float, default=6.0, metavar="SECONDS",
                        help="time_budget of the goals of the remote phase")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.remote_phase <= 0:
        return
    if not Path(args.llama_server).is_file():
        parser.error(f"--llama-server {args.llama_server}: no such file (scripts/build_native_tools.sh "
                     "builds it)")
    if not 0 < args.freeze < args.remote_phase:
        parser.error("--freeze must be > 0 and shorter than --remote-phase")
    if args.remote_budget <= 0:
        parser.error("--remote-budget must be > 0")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemotePhase:
    """One remote phase of a :class:`~.driver.Soak` run; see the module docstring.

    ``active`` is True while the node serves remotely: goals sent then carry ``budget``;
    ``finished`` once the phase is over (the soak's clients keep sending goals until then)."""

    def __init__(self, soak: Any, args: argparse.Namespace) -> None:
        self.soak, self.args = soak, args
        self.budget = args.remote_budget
        self.active = False
        self.finished = False
        self.server: Optional[subprocess.Popen] = None
        self.url = ""
        self.window = (math.nan, math.nan)  # monotonic times of SIGSTOP and SIGCONT
        self.error = ""  # why the phase did not run to its end

    def run(self) -> None:
        """Start the server, serve remotely with a freeze, go back to local; never raises (a
        failure is kept in ``error`` and fails the phase's check)."""
        try:
            self._serve_remotely()
        except Exception as exc:  # noqa: BLE001
            self.error = repr(exc)
        finally:
            self.active = False
            try:
                self.soak.reconfigure({"backend": "local"})
            except Exception as exc:  # noqa: BLE001
                self.error = self.error or f"back to backend local: {exc!r}"
            finally:
                self.stop()
                self.finished = True

    def _serve_remotely(self) -> None:
        self._start_server(self.soak.model_path())
        self.soak.reconfigure({"backend": "remote", "remote.url": self.url,
                               "remote.connect_timeout": CONNECT_TIMEOUT,
                               "remote.read_timeout": self.budget / 2, "remote.probe_period": 0.5})
        self.active = True
        started = time.monotonic()
        self._sleep_until(started + (self.args.remote_phase - self.args.freeze) / 2)
        os.kill(self.server.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            self._sleep_until(frozen_at + self.args.freeze)
        finally:
            os.kill(self.server.pid, signal.SIGCONT)
            self.window = (frozen_at, time.monotonic())
        self._sleep_until(started + self.args.remote_phase)

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.kill(self.server.pid, signal.SIGCONT)  # a stopped process does not act on SIGTERM
            self.server.terminate()
            try:
                self.server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=15)

    def _start_server(self, model: str) -> None:
        port = free_port()
        argv = [self.args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                "-t", "1", "-tb", "1", "-c", "2048", "-np", "1"]
        with open(self.soak.out / "llama-server.log", "wb") as log:
            self.server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(port):
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start; see {self.soak.out / 'llama-server.log'}")
            time.sleep(0.2)

    def _sleep_until(self, when: float) -> None:
        while time.monotonic() < when:
            time.sleep(min(0.2, max(0.0, when - time.monotonic())))

    def checks(self, records: Sequence[Any]) -> Dict[str, Dict[str, Any]]:
        """The phase's checks, from the soak's goal records (``remote``, ``time_budget``)."""
        frozen_at, resumed_at = self.window
        if self.error or math.isnan(frozen_at):
            failed = {"pass": False, "detail": f"the phase did not run: {self.error or 'no freeze'}"}
            return {"remote phase: goals during the freeze ended": failed}
        during = [r for r in records if r.remote and r.accepted and r.sent_at <= resumed_at
                  and (not r.result_at or r.result_at >= frozen_at)]
        late = [(r.index, r.finish_reason or "no result",
                 round(r.result_at - r.sent_at, 1) if r.result_at else None)
                for r in during if not r.result_at or r.result_at - r.sent_at > r.time_budget + FREEZE_MARGIN]
        reasons: Dict[str, int] = {}
        for r in during:
            reasons[r.finish_reason or "no result"] = reasons.get(r.finish_reason or "no result", 0) + 1
        after = [r for r in records if r.remote and r.accepted and r.sent_at > resumed_at + 1.0]
        served = [r for r in after if r.finish_reason in ("stop", "length")]
        return {
            "remote phase: goals during the freeze ended": {
                "pass": bool(during) and not late,
                "detail": f"{self.args.freeze:g} s frozen; {len(during)} goals alive then: {reasons}; "
                          f"over budget + {FREEZE_MARGIN:g} s or lost (index, reason, s): {late[:10]}"},
            "remote phase: served after the resume": {
                "pass": bool(served),
                "detail": f"{len(served)} of {len(after)} goals sent after the resume succeeded"},
        }

    def metrics(self) -> Dict[str, Any]:
        frozen_at, resumed_at = self.window
        t0 = self.soak.t0
        return {"url": self.url, "freeze_s": [frozen_at - t0, resumed_at - t0], "budget_s": self.budget,
                "error": self.error}


def _healthy(port: int) -> bool:
    """llama-server answers /health with 200 once its model is loaded (503 before)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


__all__ = ["RemotePhase", "add_arguments", "check_arguments", "DEFAULT_LLAMA_SERVER"]
