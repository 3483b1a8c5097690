"""The bench's ``--via-remote URL`` runner: the same prompts streamed from an OpenAI-compatible
server (llama-server, vLLM, llama_cpp.server) through :class:`~gemma_spec_ros.engine.remote.RemoteEngine`,
the client the node uses with ``backend: remote``.

It runs in the bench's own process (the generation happens in the server, whose memory is not
ours to report) and is interleaved with the local runners like any other, so its ratios against
local ``off`` (and against ``lcp-plain``, the same llama.cpp library in-process, which isolates the
HTTP + server overhead) are same-run ratios. The server's own speculation, if any, shows in tau
when the server reports it (see the RemoteEngine's docstring).

``python -m gemma_spec_dev.bench.remote URL --model GGUF`` measures the fixed cost of a request
over HTTP: the probe's round trip (GET /health) and a one-token completion through RemoteEngine
against the same one-token completion by llama-cpp-python in-process, alternated, medians written
as JSON (docs/deployment.md quotes them). ``--concurrency 1,2,4`` instead starts that many streams
together at each level and reports per-stream and aggregate decode rates (``T(c)`` of the
robots-per-server arithmetic) on a server that decodes several requests at once (llama-server
``-np``, vLLM; llama_cpp.server serves one at a time).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import SamplingParams, SpecConfig
from .config import REFERENCE_RUNNER, RunnerSpec
from .runner import RunResult, Timeline, stats_dict

#: Prompt of the overhead measurement: short, so the prompt pass is a small share.
OVERHEAD_PROMPT = "The robot picked up the"

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
        status = self._engine.status()
        if status["server reachable"] is not True:
            self._engine.close()
            raise RuntimeError(f"server {url} unreachable: {status['server error']}")
        self.info: Dict[str, Any] = {"url": url, "model_info": self._engine.model_info(),
                                     "probe_rtt_ms": status["server RTT ms"]}
        self.peak_rss_mb = 0.0  # the server's memory is not this process's
        self.base_rss_mb: Optional[float] = None

    def run(self, request: Mapping[str, Any]) -> RunResult:
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
        wall, ttft, n_first = timeline.finish()
        stats = last.stats if last is not None else None
        self.info["probe_rtt_ms"] = self._engine.status()["server RTT ms"]
        return RunResult(text="".join(texts), n_tokens=stats.num_generated_tokens if stats is not None else 0,
                         wall_s=wall, ttft_s=ttft, n_first=n_first,
                         finish_reason=last.finish_reason if last is not None else "error",
                         stats=stats_dict(stats) if stats is not None else None,
                         spec_modes=[last.spec_mode] if last is not None else [])

    def close(self) -> None:
        self._engine.close()


def measure_overhead(url: str, model_path: str, repeats: int = 20, threads: int = 1) -> Dict[str, Any]:
    """Medians (ms) of GET /health, of a one-token completion through RemoteEngine, and of the same
    completion by llama-cpp-python in-process (same model file, ``threads`` threads, greedy);
    remote minus local is the cost of serving one request over HTTP (connect, JSON, SSE, the
    server's request handling), which a streamed generation pays once."""
    import llama_cpp

    engine = RemoteEngine(RemoteConfig(url=url, probe_period=0), SpecConfig())
    local = llama_cpp.Llama(model_path=os.path.expanduser(model_path), n_ctx=256, n_threads=threads,
                            n_threads_batch=threads, verbose=False)
    request = GenerationRequest(prompt=OVERHEAD_PROMPT, max_tokens=1)
    probe, remote, inproc = [], [], []
    try:
        for i in range(repeats + 1):  # the first round warms both up and is dropped
            t0 = time.perf_counter()
            engine.probe()
            t1 = time.perf_counter()
            for _ in engine.generate(request):
                pass
            t2 = time.perf_counter()
            local.create_completion(OVERHEAD_PROMPT, max_tokens=1, temperature=0.0)
            t3 = time.perf_counter()
            if i:
                probe.append(t1 - t0)
                remote.append(t2 - t1)
                inproc.append(t3 - t2)
    finally:
        engine.close()
        local.close()
    med = {k: statistics.median(v) * 1e3 for k, v in
           (("probe_rtt_ms", probe), ("remote_one_token_ms", remote), ("local_one_token_ms", inproc))}
    return {"url": url, "server": engine.kind, "model": model_path, "repeats": repeats,
            "threads": threads, **med,
            "request_overhead_ms": med["remote_one_token_ms"] - med["local_one_token_ms"],
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def measure_concurrency(url: str, concurrency: int, max_tokens: int = 64,
                        prompt: str = OVERHEAD_PROMPT) -> Dict[str, Any]:
    """``concurrency`` streams started together (one RemoteEngine each, greedy, ``max_tokens``
    tokens; the prompts differ by a number so no server shares their cache): each stream's decode
    rate and TTFT, their sum ``T(c)`` (aggregate decode rate while all run) and the batch's wall
    time. What docs/deployment.md's robots-per-server arithmetic needs, on the server at hand."""
    results: List[Any] = [None] * concurrency
    barrier = threading.Barrier(concurrency)

    def one(i: int) -> None:
        engine = RemoteEngine(RemoteConfig(url=url, probe_period=0), SpecConfig())
        try:
            request = GenerationRequest(prompt=f"{prompt} {i + 1}", max_tokens=max_tokens)
            barrier.wait()
            last = None
            for last in engine.generate(request):
                pass
            results[i] = last.stats if last is not None else None
        except Exception as exc:  # noqa: BLE001  reported, not raised, so the others finish
            results[i] = exc
        finally:
            engine.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [str(r) for r in results if not hasattr(r, "tokens_per_second")]
    stats = [r for r in results if hasattr(r, "tokens_per_second")]
    rates = [s.tokens_per_second for s in stats]
    return {"concurrency": concurrency, "max_tokens": max_tokens, "errors": errors,
            "stream_tokens_per_s": statistics.median(rates) if rates else None,
            "aggregate_tokens_per_s": sum(rates) if rates else None,
            "ttft_ms": statistics.median(s.time_to_first_token for s in stats) * 1e3 if stats else None,
            "tau": statistics.median(s.mean_acceptance_length for s in stats) if stats else None,
            "wall_s": wall, "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=measure_overhead.__doc__.split("\n")[0])
    parser.add_argument("url", help="base URL of a running server serving --model")
    parser.add_argument("--model", default="", help="the GGUF the server serves (overhead: in-process)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", default="", metavar="1,2,4",
                        help="instead: streams started together at each of these concurrencies")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (--concurrency)")
    args = parser.parse_args(argv)
    if args.concurrency:
        out: Any = [measure_concurrency(args.url, int(c), args.max_tokens)
                    for c in args.concurrency.split(",")]
    elif not args.model:
        parser.error("--model is needed for the overhead measurement")
    else:
        out = measure_overhead(args.url, args.model, args.repeats, args.threads)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
