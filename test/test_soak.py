"""gemma-spec-soak's smoke profile: the real server subprocess (embedded model, one thread) driven by
the soak tool over loopback DDS. Invariants only (no timing assertions): 0 lost goals, invalid goals
and parameters refused with a reason, cancels end CANCELED, streamed == result text, the same greedy
output at the end, exit status 0 after SIGINT with goals running and queued, a valid cache file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from gemma_spec_ros.tools.soak import Soak, percentiles, render_svg, slope


def test_helpers() -> None:
    assert percentiles([3.0, 1.0, 2.0])["p50"] == 2.0
    assert slope([0, 10], [100, 101]) == pytest.approx(0.1)
    assert "<polyline" in render_svg([{"t": 0.0, "rss_mib": 1.0}, {"t": 1.0, "rss_mib": 2.0}])


class _Handle:
    """A goal handle whose result requests are answered from the ``answers`` list, in order (None:
    never answered). A fake: the client-side race it stands for (rclpy dropping a result response
    that arrives before get_result_async stored its future) cannot be produced on demand."""

    def __init__(self, answers):
        self.answers, self.requests = list(answers), 0

    def get_result_async(self):
        self.requests += 1
        answer = self.answers.pop(0) if self.answers else None
        return SimpleNamespace(add_done_callback=lambda done: done(SimpleNamespace(result=lambda: answer))
                               if answer is not None else None)


def test_a_dropped_result_response_is_asked_for_again_and_not_counted_lost() -> None:
    """Soak found it (1 of 3,796 goals, 30 minutes): the node answered, the client dropped the
    response ("Ignoring unexpected result response") and the goal counted as lost. The soak now
    asks again; a goal is lost only if no request is ever answered."""
    args = SimpleNamespace(goal_timeout=1.0, result_resend=0.05)
    for answers, found in (([None, "result"], True), ([None, None], False)):
        finished, got = threading.Event(), []

        def on_result(future, resent=False):
            got.append((future.result(), resent))
            finished.set()

        handle = _Handle(answers[1:])  # answers[0]: the first request, sent before the wait
        assert Soak._wait_result(SimpleNamespace(args=args), finished, {"handle": handle}, on_result) is found
        assert got == ([("result", True)] if found else [])
        assert handle.requests >= 1


@pytest.mark.timeout(420)
def test_smoke_profile(repo_root: Path, embedded_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cache = tmp_path / "dynamic.bin"
    overrides = {"target.model_path": str(embedded_model_path), "target.n_threads": 1,
                 "target.n_ctx": 1024, "limits.max_prompt_tokens": 256, "limits.max_tokens": 64,
                 "generation.max_tokens": 12, "lookup.dynamic_path": str(cache),
                 "lookup.cache_dir": str(tmp_path),
                 "lookup.save_period": 2.0, "diagnostics.period": 0.5}
    cmd = [sys.executable, "-m", "gemma_spec_ros.tools.soak",
           "--params-file", str(repo_root / "config" / "embedded.yaml"),
           "--node-name", f"gemma_spec_soak_{os.getpid()}",
           "--goals", "40", "--clients", "2", "--cycles", "1", "--cleanup-cycles", "1",
           "--flip-period", "0.5", "1.5", "--sample-period", "2", "--warmup", "5",
           "--max-tokens", "12", "--goal-timeout", "120", "--final-goals", "3",
           "--out", str(out), "--no-progress"]
    for name, value in overrides.items():
        cmd += ["--set", f"{name}:={value}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    report = json.loads((out / "soak.json").read_text())
    failed = {name: check for name, check in report["checks"].items() if not check["pass"]}
    assert not failed, (failed, proc.stderr[-3000:])
    assert proc.returncode == 0
    assert report["metrics"]["accepted"] > 0 and report["metrics"]["rejected"] > 0
    assert (out / "soak.md").is_file() and (out / "rss.svg").is_file()
