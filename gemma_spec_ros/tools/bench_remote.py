"""The bench's ``--via-remote URL`` runner: the same prompts streamed from an OpenAI-compatible
server (llama-server, vLLM, llama_cpp.server) through :class:`~gemma_spec_ros.engine.remote.RemoteEngine`,
the client the node uses with ``backend: remote``.

It runs in the bench's own process (the generation happens in the server, whose memory is not
ours to report) and is interleaved with the local runners like any other, so its ratios against
local ``off`` (and against ``lcp-plain``, the same llama.cpp library in-process, which isolates the
HTTP + server overhead) are same-run ratios. The server's own speculation, if any, shows in tau
when the server reports it (see the RemoteEngine's docstring).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Mapping, Optional

from ..engine.remote import RemoteConfig, RemoteEngine
from ..engine.types import GenerationRequest, SamplingParams, SpecConfig
from .bench_config import REFERENCE_RUNNER, RunnerSpec
from .bench_worker import Timeline, stats_dict

RUNNER_NAME = "remote"


def remote_runners(url: str, baselines: List[str]) -> List[RunnerSpec]:
    """The remote runner for ``--via-remote URL`` ('' = none). Its own reference is llama-cpp-python
    in-process when that baseline runs (the ratio is then the cost of serving over HTTP)."""
    if not url:
        return []
    return [RunnerSpec(RUNNER_NAME, "remote", "server", None,
                       "lcp-plain" if "plain" in baselines else REFERENCE_RUNNER)]


class RemoteRunner:
    """Streams each bench request from the server; same interface as a worker handle."""

    def __init__(self, spec: RunnerSpec, url: str, params: Mapping[str, Any]) -> None:
        self.spec = spec
        config = RemoteConfig(url=url, model=str(params.get("remote.model", "") or ""),
                              api_key_env=str(params.get("remote.api_key_env", "") or ""),
                              read_timeout=float(params.get("remote.read_timeout", 600.0) or 600.0),
                              probe_period=0)
        self._engine = RemoteEngine(config, SpecConfig())
        status = self._engine.backend_status()
        if status["server reachable"] is not True:
            self._engine.close()
            raise RuntimeError(f"server {url} unreachable: {status['server error']}")
        self.info: Dict[str, Any] = {"url": url, "model_info": self._engine.model_info(),
                                     "probe_rtt_ms": status["server RTT ms"]}
        self.peak_rss_mb = 0.0  # the server's memory is not this process's
        self.base_rss_mb: Optional[float] = None

    def run(self, request: Mapping[str, Any]) -> Dict[str, Any]:
        sampling = SamplingParams(temperature=float(request["temperature"]), seed=int(request["seed"]))
        req = GenerationRequest(prompt=request["prompt"], max_tokens=int(request["max_tokens"]),
                                sampling=sampling)
        texts: List[str] = []
        last = None
        emitted = 0
        timeline = Timeline()
        for step in self._engine.generate(req, threading.Event()):
            timeline.output(step.stats.num_generated_tokens - emitted if step.text else 0)
            emitted = step.stats.num_generated_tokens
            texts.append(step.text)
            last = step
        out: Dict[str, Any] = timeline.finish()
        stats = last.stats if last is not None else None
        out.update(text="".join(texts), tokens=None,
                   n_tokens=stats.num_generated_tokens if stats is not None else 0,
                   finish_reason=last.finish_reason if last is not None else "error",
                   stats=stats_dict(stats) if stats is not None else None,
                   spec_modes=[last.spec_mode] if last is not None else [], draft_max_last=None)
        self.info["probe_rtt_ms"] = self._engine.backend_status()["server RTT ms"]
        return out

    def close(self) -> None:
        self._engine.close()
