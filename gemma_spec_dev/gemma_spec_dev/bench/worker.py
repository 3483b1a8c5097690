"""The bench's worker process: holds one runner (an engine mode, a llama-cpp-python baseline, or an
action client) and generates on request, so each runner's peak RSS is its own process's.

Protocol: one JSON object per line. The parent writes ``{"cmd": "init", "runner": {...},
"params": {...}, "threads": N}``, then ``{"cmd": "run", "request": {...}}`` any number of times, then
``{"cmd": "close"}``; each gets one reply line ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
The reply channel is a private copy of the original stdout; fd 1 is pointed at stderr so that anything
a library prints cannot corrupt the protocol.

Run as ``python -m gemma_spec_dev.bench.worker`` (the parent does this).
"""
from __future__ import annotations

from gemma_spec_ros.engine.llama.process import import_llama_cpp_first

import_llama_cpp_first()

import json  # noqa: E402
import os
import resource
import sys
import threading
from typing import Any, Dict, Iterable, List, Optional, TextIO

from .config import RunnerSpec, engine_config, model_config, thread_count
from .runner import Request, RunResult, Runner, Timeline, stats_dict


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB: ``VmHWM`` of /proc/self/status (the
    peak of this program's own memory map), else ``ru_maxrss``. Linux keeps ``ru_maxrss`` across
    exec: a worker started by a process of 1.7 GiB (a long pytest run) reported 1.7 GiB as its
    base and as its peak, whatever it loaded."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def stats_from_msg(msg: Any) -> Dict[str, Any]:
    """A gemma_spec_msgs/SpecStats as the same figures by name (every field but the header), the
    reverse of the node's ``spec_stats_msg``."""
    return {name: list(getattr(msg, name)) if ros_type.startswith("sequence<") else getattr(msg, name)
            for name, ros_type in msg.get_fields_and_field_types().items() if name != "header"}


class EngineRunner:
    """Our engine in one mode, with K fixed or adaptive (one Engine per worker)."""

    def __init__(self, spec: RunnerSpec, params: Dict[str, Any]) -> None:
        from gemma_spec_ros.engine.engine import Engine  # imported here: the parent process never loads models

        self._mode = spec.mode
        self._reuse_prompt = spec.reuse_prompt
        self._engine = Engine(engine_config(params, spec.mode, spec.draft_max, spec.adaptive_max))
        self.info = {"model_info": self._engine.model_info(), "spec": repr(self._engine.spec)}

    def run(self, request: Request) -> RunResult:
        from gemma_spec_ros.engine.request import GenerationRequest
        from gemma_spec_ros.engine.config import SamplingParams

        sampling = SamplingParams(temperature=float(request["temperature"]), seed=int(request["seed"]))
        req = GenerationRequest(prompt=request["prompt"], max_tokens=int(request["max_tokens"]),
                                sampling=sampling, spec_mode=self._mode, reuse_prompt=self._reuse_prompt)
        tokens: List[int] = []
        texts: List[str] = []
        modes: List[str] = []
        last = None
        timeline = Timeline()
        for step in self._engine.generate(req, threading.Event()):
            timeline.output(len(step.tokens))
            tokens.extend(step.tokens)
            texts.append(step.text)
            if step.spec_mode not in modes:
                modes.append(step.spec_mode)
            last = step
        wall, ttft, n_first = timeline.finish()
        return RunResult(text="".join(texts), n_tokens=len(tokens), wall_s=wall, ttft_s=ttft,
                         n_first=n_first, finish_reason=last.finish_reason if last else "error",
                         tokens=tokens, stats=stats_dict(last.stats) if last else None,
                         spec_modes=modes, draft_max_last=last.draft_max if last else None)

    def close(self) -> None:
        self._engine.close()


class LlamaCppRunner:
    """llama-cpp-python's high-level ``Llama.create_completion``: plain, or with its built-in
    ``LlamaPromptLookupDecoding`` draft model (which forces logits for every row, as shipped)."""

    def __init__(self, spec: RunnerSpec, params: Dict[str, Any]) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        target = model_config(params, "target")
        if target is None:
            raise ValueError("no target model")
        threads = thread_count(params)
        draft = None
        if spec.mode == "prompt-lookup":
            draft = LlamaPromptLookupDecoding(num_pred_tokens=spec.draft_max or 10)
        self._llm = Llama(model_path=target.resolved_path, n_ctx=target.n_ctx, n_batch=target.n_batch,
                          n_threads=threads, n_threads_batch=threads, n_gpu_layers=target.n_gpu_layers,
                          draft_model=draft, verbose=False)
        self.info = {"llama_cpp_version": __import__("llama_cpp").__version__,
                     "logits_all": bool(getattr(self._llm, "_logits_all", False))}

    def run(self, request: Request) -> RunResult:
        from llama_cpp import StoppingCriteriaList

        sampled = [0]

        def count(_ids: Any, _logits: Any) -> bool:  # called once per sampled token; never stops
            sampled[0] += 1
            return False

        timeline = Timeline()
        texts: List[str] = []
        finish = "length"
        stream = self._llm.create_completion(
            request["prompt"], max_tokens=int(request["max_tokens"]),
            temperature=float(request["temperature"]), top_k=0, top_p=1.0, min_p=0.0,
            repeat_penalty=1.0, seed=int(request["seed"]), stream=True,
            stopping_criteria=StoppingCriteriaList([count]))
        for chunk in stream:
            choice = chunk["choices"][0]
            timeline.output(1 if choice["text"] else 0)
            texts.append(choice["text"])
            finish = choice.get("finish_reason") or finish
        wall, ttft, n_first = timeline.finish()
        text = "".join(texts)
        # The end-of-generation token is sampled (and counted) but not part of the completion.
        n_tokens = sampled[0] - (1 if finish == "stop" else 0)
        # Token ids for the repetition figure: the output re-tokenized, outside the timed span.
        tokens = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) if text else []
        return RunResult(text=text, n_tokens=n_tokens, wall_s=wall, ttft_s=ttft, n_first=n_first,
                         finish_reason=finish, retokenized=list(tokens))

    def close(self) -> None:
        self._llm.close()


class ActionRunner:
    """A client of the Generate action of a running node (``/<node>/generate``)."""

    def __init__(self, spec: RunnerSpec, params: Dict[str, Any], node_name: str,
                 server_timeout_s: float = 30.0) -> None:
        # imported here: only this runner needs ROS (the bench runs on machines without it)
        import rclpy
        from gemma_spec_msgs.action import Generate
        from gemma_spec_ros.client import GenerateClient, action_name

        self._rclpy = rclpy
        self._goal = Generate.Goal
        self._mode = spec.mode
        rclpy.init(args=None)
        name = node_name if node_name.startswith("/") else "/" + node_name
        self._action = action_name(name)
        # one goal at a time, as long as the bench measures: no message history
        self._client = GenerateClient(name, name="gemma_spec_bench_client", keep_history=False)
        if not self._client.wait_for_server(server_timeout_s):
            self.close()
            raise RuntimeError(f"no Generate action server at {self._action} after {server_timeout_s:.0f} s "
                               "(start the node: gemma-spec-serve --params-file ...)")
        self.info = {"action": self._action}

    def run(self, request: Request) -> RunResult:
        goal = self._goal(prompt=request["prompt"], max_tokens=int(request["max_tokens"]),
                          temperature=float(request["temperature"]), top_p=1.0, top_k=0,
                          seed=int(request["seed"]), spec_mode=self._mode)
        modes: List[str] = []

        def on_feedback(message: Any) -> None:
            fb = message.feedback
            timeline.output(max(int(fb.completion_tokens), 1) if fb.text else 0)
            if fb.spec_mode and fb.spec_mode not in modes:
                modes.append(fb.spec_mode)

        timeline = Timeline()
        run = self._client.send_goal(goal, timeout=None, on_feedback=on_feedback)
        if not run.accepted:
            raise RuntimeError(f"goal rejected by {self._action}")
        result = run.wait_result(timeout=None)
        wall, ttft, n_first = timeline.finish()
        if result.finish_reason == "error":
            raise RuntimeError(f"node reported an error: {result.error}")
        return RunResult(text=result.text, n_tokens=int(result.completion_tokens), wall_s=wall,
                         ttft_s=ttft, n_first=n_first, finish_reason=result.finish_reason,
                         stats=stats_from_msg(result.stats), spec_modes=modes or [result.spec_mode],
                         draft_max_last=int(result.stats.draft_max))

    def close(self) -> None:
        try:
            self._client.close()
        finally:
            self._rclpy.try_shutdown()


def make_runner(spec: RunnerSpec, params: Dict[str, Any], node_name: str) -> Runner:
    """The runner object for a spec (engine, llama-cpp or action)."""
    if spec.kind == "engine":
        return EngineRunner(spec, params)
    if spec.kind == "llama-cpp":
        return LlamaCppRunner(spec, params)
    if spec.kind == "action":
        return ActionRunner(spec, params, node_name)
    raise ValueError(f"runner kind {spec.kind!r} does not run in a worker")


def serve(lines: Iterable[str], reply: TextIO) -> int:
    """Answer protocol lines until ``close`` or end of input; returns the exit status."""
    runner: Optional[Runner] = None

    def send(obj: Dict[str, Any]) -> None:
        obj["peak_rss_mb"] = peak_rss_mb()
        reply.write(json.dumps(obj, allow_nan=True) + "\n")
        reply.flush()

    for line in lines:
        if not line.strip():
            continue
        message = json.loads(line)
        cmd = message.get("cmd")
        try:
            if cmd == "init":
                base = peak_rss_mb()
                runner = make_runner(RunnerSpec(**message["runner"]), message["params"],
                                     message.get("node_name", ""))
                send({"ok": True, "info": runner.info, "base_rss_mb": base})
            elif cmd == "run":
                if runner is None:
                    raise RuntimeError("run before init")
                send({"ok": True, "result": runner.run(message["request"]).to_json()})
            elif cmd == "close":
                if runner is not None:
                    runner.close()
                send({"ok": True})
                return 0
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent as data
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


def main() -> int:
    """Entry of ``python -m gemma_spec_dev.bench.worker``."""
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints (libraries) go to stderr, never into the protocol
    sys.stdout = sys.stderr
    return serve(sys.stdin, reply)


if __name__ == "__main__":
    sys.exit(main())
