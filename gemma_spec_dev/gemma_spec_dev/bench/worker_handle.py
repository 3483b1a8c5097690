"""The parent's side of a bench worker process (:mod:`.worker`): start it, send it the protocol's
lines, read the replies, keep its peak RSS."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from typing import IO, Any, Dict, Mapping, Optional

from .config import RunnerSpec
from .runner import Request, RunResult


class RunnerError(RuntimeError):
    """A runner failed to start or to serve a request (the bench records it and goes on)."""


class WorkerHandle:
    """The parent's side of one bench worker process."""

    def __init__(self, spec: RunnerSpec, params: Mapping[str, Any], node_name: str, log: IO[bytes],
                 timeout_s: float) -> None:
        self.spec = spec
        self._timeout_s = timeout_s
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gemma_spec_dev.bench.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        self.peak_rss_mb = 0.0
        reply = self._call({"cmd": "init", "runner": asdict(spec), "params": dict(params),
                            "node_name": node_name})
        self.info: Dict[str, Any] = reply.get("info", {})
        self.base_rss_mb: Optional[float] = reply.get("base_rss_mb")

    def _call(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        if self._proc.poll() is not None:
            raise RunnerError(f"worker of {self.spec.name} has exited ({self._proc.returncode}); see workers.log")
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            raise RunnerError(f"worker of {self.spec.name} is gone: {exc}; see workers.log") from None
        if not line:
            self._proc.wait(timeout=5)
            raise RunnerError(f"worker of {self.spec.name} died ({self._proc.returncode}); see workers.log")
        reply = json.loads(line)
        self.peak_rss_mb = max(self.peak_rss_mb, float(reply.get("peak_rss_mb") or 0.0))
        if not reply.get("ok"):
            raise RunnerError(str(reply.get("error")))
        return reply

    def run(self, request: Request) -> RunResult:
        result = RunResult.from_json(self._call({"cmd": "run", "request": dict(request)})["result"])
        result.peak_rss_mb = self.peak_rss_mb
        return result

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._call({"cmd": "close"})
                self._proc.wait(timeout=30)
            except (RunnerError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
