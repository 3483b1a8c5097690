"""``gemma-spec-soak``: run ``gemma-spec-serve`` as a subprocess and drive it like a busy robot.

    gemma-spec-soak --params-file config/embedded.yaml --goals 5000 --clients 3 --out soak/ \\
        --set target.n_threads:=2

What it does (seeded, so a run can be repeated):

- ``--clients`` threads send ``--goals`` goals in all: valid ones (greedy, seeded-sampled, chat
  template, stop lists, prompts near the limits, priorities) and invalid ones of every kind the node
  must refuse; a share of the accepted goals is cancelled at a random point: in the goal-response
  callback, right after acceptance (queued or in prompt evaluation), mid-stream after k feedback
  messages, or after a random delay (near or after the last feedback);
- a parameter thread sets runtime parameters every ``--flip-period`` seconds (valid values, which
  must be accepted, and invalid ones, which must be refused with a reason) and runs the lifecycle
  cycles (``--cycles`` deactivate/activate, ``--cleanup-cycles`` cleanup/configure/activate, and
  with ``--remote-phase`` a phase on ``backend: remote`` with a real llama-server frozen by SIGSTOP
  for ``--freeze`` seconds: see :mod:`gemma_spec_dev.soak.remote_phase`);
- at the end it sends a few goals and, with them running and queued, stops the server with SIGINT.

Checks (each PASS/FAIL in the report): every accepted goal got one result (0 lost); every invalid
goal and parameter was refused (with a reason logged / returned); a goal whose cancel was accepted
ended CANCELED (or SUCCEEDED if it finished first); streamed text equals the result text; the same
greedy output at the end as at the start; exit status 0; the dynamic cache file valid afterwards.
Opt-in checks for long runs: ``--max-rss-slope`` (RSS slope after warm-up) and ``--cancel-bound``
(p99 cancel-to-result within one prompt chunk + 2 target passes, both taken from the results' own
timings: p99 of prompt time per ``n_batch`` chunk and of verify time per pass).

Measures: latency, queue wait and cancel-to-result p50/p95/p99; the server's RSS (total, anonymous,
file-backed), threads and open files every ``--sample-period`` seconds with their slope (per 1,000
goals and per hour, after ``--warmup`` goals, leaving out samples taken during a cleanup cycle);
the dynamic cache's n-grams (from /diagnostics). Writes ``soak.json``,
``soak.md`` and ``rss.svg`` to ``--out``; a progress bar on stderr. Exit status 0 if every check
passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import remote_phase as soak_remote

# Kept free of rclpy at import time (the module is imported by tests that only parse arguments).

#: Cancel points of a cancelled goal (see the module docstring).
CANCEL_POINTS = ("response", "accepted", "stream", "delay")
COMPLETION_PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The robot moved to the kitchen. The robot picked up the cup. The robot",
    "Step 1: open the gripper.\nStep 2: move to the shelf.\nStep 3:",
    "List of rooms: kitchen, hallway, office, lab, kitchen, hallway,",
)
GOLDEN = dict(prompt="def mul(a, b):\n    return a * b\n\ndef div(a, b):\n", max_tokens=24,
              temperature=0.0, seed=1, spec_mode="off")


@dataclass
class GoalRecord:
    """One goal as the soak client saw it."""

    index: int
    kind: str
    invalid: bool
    cancel_point: str = ""
    accepted: Optional[bool] = None
    status: int = 0
    finish_reason: str = ""
    error: str = ""
    streamed: str = ""
    text: str = ""
    sent_at: float = 0.0
    result_at: float = 0.0
    cancel_at: float = 0.0
    cancel_accepted: Optional[bool] = None
    queue_wait: float = math.nan  # acceptance -> first feedback of the running goal (client side)
    accepted_at: float = 0.0
    started_at: float = 0.0
    lost: bool = False
    # the result came only for a re-sent result request: the first one's response was dropped by
    # the client (ros2/rclpy#1123, result side; the driver logs "Ignoring unexpected result response")
    result_resent: bool = False
    remote: bool = False  # sent during the remote phase
    time_budget: float = 0.0  # the goal's time_budget (0 = none)
    step_ms: float = math.nan  # the result's verify time per target pass (server side)
    chunk_ms: float = math.nan  # the result's prompt time per evaluated n_batch chunk (server side)


@dataclass
class Sample:
    t: float
    goals_done: int
    rss_mib: float
    threads: int
    open_files: int
    ngrams: int
    rss_anon_mib: float = math.nan  # heap and other private memory: where a leak shows
    rss_file_mib: float = math.nan  # mapped files (the GGUF's pages as they are touched)
    serving: bool = True  # False during a cleanup cycle or the remote phase (no model): not in the slopes


@dataclass
class Report:
    config: Dict[str, Any]
    checks: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    metrics: Dict[str, Any] = field(default_factory=dict)
    samples: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check["pass"] for check in self.checks.values())


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gemma-spec-soak", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-file", action="append", default=[], metavar="YAML",
                        help="the server's parameters file(s)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME:=VALUE",
                        help="a server parameter override (repeatable)")
    parser.add_argument("--node-name", default="gemma_spec_soak")
    parser.add_argument("--goals", type=int, default=300)
    parser.add_argument("--duration", type=float, default=0.0, metavar="SECONDS",
                        help="keep sending goals until this long has passed, even past --goals")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--invalid-share", type=float, default=0.15)
    parser.add_argument("--cancel-share", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens of a valid goal")
    parser.add_argument("--flip-period", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN", "MAX"))
    parser.add_argument("--cycles", type=int, default=2, help="deactivate/activate cycles")
    parser.add_argument("--cleanup-cycles", type=int, default=1, help="cleanup/configure cycles")
    parser.add_argument("--final-goals", type=int, default=3,
                        help="goals running and queued when SIGINT stops the server")
    parser.add_argument("--sample-period", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=50, help="goals before the slopes are fitted")
    parser.add_argument("--goal-timeout", type=float, default=300.0)
    parser.add_argument("--result-resend", type=float, default=20.0,
                        help="seconds without a result before the result is requested again "
                             "(below the node's queue.result_timeout, 60 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak", help="folder for soak.json, soak.md, rss.svg, serve.log")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--max-rss-slope", type=float, default=None, metavar="MIB",
                        help="check: RSS slope after warm-up below MIB per 1,000 goals (default: reported only)")
    parser.add_argument("--cancel-bound", action="store_true",
                        help="check: p99 cancel-to-result within one prompt chunk + 2 steps (p99 of each, "
                             "from the results' own timings)")
    soak_remote.add_arguments(parser)
    args = parser.parse_args(argv)
    soak_remote.check_arguments(parser, args)
    return args


def server_n_batch(params_files: Sequence[str], overrides: Dict[str, str]) -> int:
    """The server's ``target.n_batch``: an override, else the last params file naming it, else 512."""
    if "target.n_batch" in overrides:
        return int(overrides["target.n_batch"])
    import yaml
    n_batch = 512
    for path in params_files:
        with open(path) as fh:
            for section in (yaml.safe_load(fh) or {}).values():
                value = ((section or {}).get("ros__parameters") or {}).get("target", {}).get("n_batch")
                n_batch = int(value) if value else n_batch
    return n_batch


def cycle_plan(rng: random.Random, cycles: Sequence[str], goals: int) -> List[Tuple[int, str]]:
    """(goal index, cycle) pairs in index order, at random indices below ``goals``. With fewer goals
    than cycles some are left out, never the remote phase (the clients keep sending until it ran).

    >>> cycle_plan(random.Random(0), ["deactivate", "cleanup", "remote"], 2)
    [(1, 'remote')]
    """
    marks = sorted(rng.sample(range(1, max(2, goals)), min(len(cycles), max(1, goals - 1))))
    labels = rng.sample(list(cycles), len(cycles))[:len(marks)]
    if "remote" in cycles and "remote" not in labels:
        labels[-1] = "remote"
    return list(zip(marks, labels))


def percentiles(values: Sequence[float]) -> Dict[str, float]:
    """p50/p95/p99 (nearest rank) of ``values``; NaN when empty.

    >>> percentiles([1, 2, 3, 4])["p50"]
    2
    """
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "n": 0}
    def rank(q: float) -> float:
        return data[max(0, math.ceil(q / 100 * len(data)) - 1)]
    return {"p50": rank(50), "p95": rank(95), "p99": rank(99), "n": len(data)}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs; NaN with fewer than 2 distinct xs.

    >>> slope([0, 1, 2], [1, 3, 5])
    2.0
    """
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def proc_sample(pid: int) -> Dict[str, float]:
    """RSS (total, anonymous, file-backed; MiB), threads and open files of process ``pid`` from
    /proc; an empty dict when the process is gone."""
    keys = {"VmRSS:": "rss_mib", "RssAnon:": "rss_anon_mib", "RssFile:": "rss_file_mib",
            "Threads:": "threads"}
    values: Dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                name = line.split(None, 1)[0] if line.strip() else ""
                if name in keys:
                    number = int(line.split()[1])
                    values[keys[name]] = number if name == "Threads:" else number / 1024
        values["open_files"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    return values


def _guarded(callback: Callable[[Any], None]) -> Callable[[Any], None]:
    """``callback`` with its exceptions printed, never raised into the executor (which would die)."""
    def call(arg: Any) -> None:
        try:
            callback(arg)
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f"\ngemma-spec-soak: callback failed: {exc!r}\n")
    return call


# -- goals -----------------------------------------------------------------------------------------
def invalid_goals(limits: Dict[str, int]) -> List[Tuple[str, Dict[str, Any]]]:
    """(kind, goal fields) of goals the node must reject, whatever its runtime parameters."""
    nan = float("nan")
    return [
        ("empty prompt", dict(prompt="")),
        ("temperature nan", dict(prompt="hi", temperature=nan)),
        ("temperature negative", dict(prompt="hi", temperature=-2.0)),
        ("top_p > 1", dict(prompt="hi", top_p=1.5)),
        ("top_k < -1", dict(prompt="hi", top_k=-5)),
        ("unknown spec_mode", dict(prompt="hi", spec_mode="warp" * 50)),
        ("seed < -1", dict(prompt="hi", seed=-7)),
        ("time_budget negative", dict(prompt="hi", time_budget=-1.0)),
        ("max_tokens over the limit", dict(prompt="hi", max_tokens=limits["max_tokens"] + 1)),
        ("empty stop string", dict(prompt="hi", stop=["ok", ""])),
        ("too many stop strings", dict(prompt="hi", stop=[f"s{i}" for i in range(limits["max_stop_strings"] + 1)])),
        ("stop string too long", dict(prompt="hi", stop=["x" * (limits["max_stop_length"] + 1)])),
        ("prompt over max_prompt_bytes", dict(prompt="é" * (limits["max_prompt_bytes"] // 2 + 1))),
        # over the limit even on the remote backend's lower-bound estimate (16 bytes per token)
        ("prompt over max_prompt_tokens",
         dict(prompt=" ".join(f"w{i}" for i in range(min(17 * limits["max_prompt_tokens"] // 4,
                                                          limits["max_prompt_bytes"] // 6))))),
        ("draft mode without a draft model", dict(prompt="hi", spec_mode="draft")),
    ]


def valid_goal(rng: random.Random, limits: Dict[str, int], max_tokens: int) -> Tuple[str, Dict[str, Any]]:
    """(kind, goal fields) of a goal the node must accept when active with room in its queue."""
    prompt = rng.choice(COMPLETION_PROMPTS)
    tokens = rng.randint(1, max_tokens)
    roll = rng.random()
    if roll < 0.35:
        return "greedy", dict(prompt=prompt, max_tokens=tokens, temperature=0.0, seed=1)
    if roll < 0.55:
        return "sampled", dict(prompt=prompt, max_tokens=tokens, temperature=0.8, top_p=0.95,
                               seed=rng.randint(0, 1 << 30))
    if roll < 0.65:
        return "chat", dict(prompt="Name a room.", system_prompt=rng.choice(["", "Be brief."]),
                            use_chat_template=True, max_tokens=tokens, temperature=0.0)
    if roll < 0.8:
        stops = rng.sample(["\n", "def", "The", ",", "Step", ")"], rng.randint(1, 4))
        return "stop list", dict(prompt=prompt, max_tokens=tokens, temperature=0.0, stop=stops)
    if roll < 0.9:
        words = max(8, int(limits["max_prompt_tokens"] * 0.4))
        return "long prompt", dict(prompt=" ".join(["kitchen hallway"] * (words // 2)), max_tokens=tokens,
                                   temperature=0.0)
    return "priority", dict(prompt=prompt, max_tokens=tokens, temperature=0.0,
                            priority=rng.randint(0, 3), preempt=rng.random() < 0.3)


# -- the soak ----------------------------------------------------------------------------------------
class Soak:
    """The server subprocess, the ROS client and the bookkeeping of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(args.seed)
        self.records: List[GoalRecord] = []
        self.lock = threading.Lock()
        self.next_index = 0
        self.param_results: List[Dict[str, Any]] = []
        self.transitions: List[Dict[str, Any]] = []
        self.samples: List[Sample] = []
        self.ngrams = 0
        self.stop_event = threading.Event()
        # cleared while a cleanup/configure cycle re-creates the action server: a goal request sent
        # before DDS matches the new server's services is never delivered (no response at all)
        self.serving = threading.Event()
        self.serving.set()
        self.in_flight = 0  # goals the client threads are running (under self.lock)
        self.server: Optional[subprocess.Popen] = None
        self.overrides = dict(item.split(":=", 1) for item in args.set)
        self.n_batch = server_n_batch(args.params_file, self.overrides)
        self.remote = soak_remote.RemotePhase(self, args) if args.remote_phase > 0 else None

    # server ---------------------------------------------------------------------------------------
    def start_server(self) -> None:
        cmd = [sys.executable, "-m", "gemma_spec_ros.tools.serve", "--node-name", self.args.node_name]
        for path in self.args.params_file:
            cmd += ["--params-file", path]
        if self.overrides:
            cmd += ["--ros-args"] + [a for k, v in self.overrides.items() for a in ("-p", f"{k}:={v}")]
        log = open(self.out / "serve.log", "w")
        # SIGINT restored in the child: a background process of a non-interactive shell inherits
        # SIG_IGN (serve installs its own handler anyway); its own session, like a terminal's job.
        self.server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        log.close()

    # client ---------------------------------------------------------------------------------------
    def run(self) -> Report:
        import rclpy
        from rclpy.executors import MultiThreadedExecutor

        self.start_server()
        rclpy.init()
        self.node = rclpy.create_node(f"{self.args.node_name}_driver")
        executor = MultiThreadedExecutor(num_threads=4)
        executor.add_node(self.node)
        spinner = threading.Thread(target=executor.spin, daemon=True)
        spinner.start()
        try:
            return self._drive()
        finally:
            if self.remote is not None:
                self.remote.stop()
            if self.server is not None and self.server.poll() is None:
                self.server.kill()
            executor.shutdown(timeout_sec=2.0)
            self.node.destroy_node()
            rclpy.try_shutdown()

    def _drive(self) -> Report:
        from diagnostic_msgs.msg import DiagnosticArray
        from gemma_spec_msgs.action import Generate
        from rclpy.action import ActionClient

        path = f"/{self.args.node_name}"
        from rclpy.qos import QoSProfile
        # a deep feedback queue: the client must not drop a burst of one-token steps itself
        self.action = ActionClient(self.node, Generate, f"{path}/generate",
                                   feedback_sub_qos_profile=QoSProfile(depth=1000))
        self.Goal = Generate.Goal
        # rclpy's ActionClient drops feedback that arrives after the goal's result (it forgets the
        # goal's feedback callback then), and feedback is a topic, the result a service: read the
        # feedback topic directly to compare what the server streamed with the result
        self.streams: Dict[bytes, List[str]] = {}
        self.node.create_subscription(Generate.Impl.FeedbackMessage, f"{path}/generate/_action/feedback",
                                      self._on_raw_feedback, QoSProfile(depth=1000))
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        self._make_service_clients(path)
        started = time.monotonic()
        if not self.action.wait_for_server(timeout_sec=180.0):
            raise RuntimeError(f"no action server {path}/generate after 180 s (see {self.out}/serve.log)")
        self.limits = self._limits()
        self.t0 = time.monotonic()
        golden_start = self._golden()
        sampler = threading.Thread(target=self._sample_loop, daemon=True)
        sampler.start()
        flipper = threading.Thread(target=self._flip_loop, daemon=True)
        flipper.start()
        clients = [threading.Thread(target=self._client_loop, args=(i,), daemon=True)
                   for i in range(self.args.clients)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        self.stop_event.set()
        flipper.join()
        self._ensure_active()
        golden_end = self._golden()
        final = self._final_sigint()
        sampler.join(timeout=self.args.sample_period + 5)
        exit_status = self.server.wait(timeout=120)
        self._progress(final=True)
        return self._report(golden_start, golden_end, final, exit_status, time.monotonic() - started)

    def _make_service_clients(self, path: str) -> None:
        from lifecycle_msgs.srv import ChangeState, GetState
        from rcl_interfaces.srv import GetParameters, SetParameters

        self.change_state = self.node.create_client(ChangeState, f"{path}/change_state")
        self.get_state = self.node.create_client(GetState, f"{path}/get_state")
        self.set_params = self.node.create_client(SetParameters, f"{path}/set_parameters")
        self.get_params = self.node.create_client(GetParameters, f"{path}/get_parameters")

    def _call(self, client: Any, request: Any, timeout: float = 120.0) -> Any:
        if not client.wait_for_service(timeout_sec=30.0):
            raise RuntimeError(f"service {client.srv_name} not available")
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise RuntimeError(f"no answer from {client.srv_name} in {timeout:.0f} s")
        return future.result()

    def _limits(self) -> Dict[str, int]:
        from rcl_interfaces.srv import GetParameters
        names = ["limits.max_tokens", "limits.max_prompt_tokens", "limits.max_prompt_bytes",
                 "limits.max_stop_strings", "limits.max_stop_length"]
        values = self._call(self.get_params, GetParameters.Request(names=names)).values
        return {name.split(".")[1]: value.integer_value for name, value in zip(names, values)}

    def model_path(self) -> str:
        """The node's target.model_path, for the remote phase's server."""
        from rcl_interfaces.srv import GetParameters
        [value] = self._call(self.get_params, GetParameters.Request(names=["target.model_path"])).values
        return os.path.expanduser(value.string_value)

    def _set(self, name: str, value: Any) -> Tuple[bool, str]:
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter
        request = SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()])
        result = self._call(self.set_params, request).results[0]
        return result.successful, result.reason

    def _transition(self, label: str) -> bool:
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState
        ids = {"configure": Transition.TRANSITION_CONFIGURE, "activate": Transition.TRANSITION_ACTIVATE,
               "deactivate": Transition.TRANSITION_DEACTIVATE, "cleanup": Transition.TRANSITION_CLEANUP}
        started = time.monotonic()
        ok = self._call(self.change_state, ChangeState.Request(transition=Transition(id=ids[label]))).success
        self.transitions.append({"transition": label, "ok": bool(ok), "seconds": time.monotonic() - started})
        return ok

    def _state(self) -> str:
        from lifecycle_msgs.srv import GetState
        return self._call(self.get_state, GetState.Request()).current_state.label

    def _ensure_active(self) -> None:
        state = self._state()
        if state == "unconfigured":
            self._transition("configure")
            state = self._state()
        if state == "inactive":
            self._transition("activate")

    def _on_raw_feedback(self, msg: Any) -> None:
        with self.lock:
            self.streams.setdefault(bytes(msg.goal_id.uuid), []).append(msg.feedback.text)

    def _on_diagnostics(self, msg: Any) -> None:
        for status in msg.status:
            if status.name == f"{self.args.node_name}: speculative decoding":
                for kv in status.values:
                    if kv.key == "dynamic cache n-grams":
                        try:
                            self.ngrams = int(kv.value)
                        except ValueError:
                            pass

    # goals ----------------------------------------------------------------------------------------
    def _take_index(self) -> Optional[int]:
        with self.lock:
            remote_to_come = self.remote is not None and not self.remote.finished  # it needs goals
            if (self.next_index >= self.args.goals and time.monotonic() - self.t0 >= self.args.duration
                    and not remote_to_come):
                return None
            self.next_index += 1
            return self.next_index - 1

    def _client_loop(self, client_id: int) -> None:
        rng = random.Random(self.args.seed * 1000 + client_id)
        invalid = invalid_goals(self.limits)
        while True:
            self.serving.wait()
            index = self._take_index()
            if index is None:
                return
            if rng.random() < self.args.invalid_share:
                kind, fields = rng.choice(invalid)
                record = GoalRecord(index, kind, invalid=True)
            else:
                kind, fields = valid_goal(rng, self.limits, self.args.max_tokens)
                record = GoalRecord(index, kind, invalid=False)
                if rng.random() < self.args.cancel_share:
                    record.cancel_point = rng.choice(CANCEL_POINTS)
            if self.remote is not None and self.remote.active:
                record.remote = True
                if not record.invalid:  # the phase checks that each goal ends within its budget
                    fields["time_budget"] = record.time_budget = self.remote.budget
            with self.lock:
                self.records.append(record)
                self.in_flight += 1
            try:
                self._run_goal(record, fields, rng)
            finally:
                with self.lock:
                    self.in_flight -= 1
            if record.accepted is False and not record.invalid:
                # a valid goal refused (queue full, node inactive): a client retries later, as a
                # planner would; without a pause the goal count would be spent in rejections
                # whenever the node is inactive (a rejection takes ~2 ms)
                time.sleep(rng.uniform(0.1, 0.5))
            self._progress()

    def _run_goal(self, record: GoalRecord, fields: Dict[str, Any], rng: random.Random) -> None:
        feedback: List[Any] = []
        got_feedback = threading.Condition()
        responded, finished = threading.Event(), threading.Event()
        holder: Dict[str, Any] = {}
        stream_after = rng.randint(1, 6)

        def on_feedback(msg: Any) -> None:
            with got_feedback:
                feedback.append(msg.feedback)
                got_feedback.notify_all()
            if msg.feedback.queue_position == 0 and not record.started_at:
                record.started_at = time.monotonic()
            if record.cancel_point == "stream" and len(feedback) == stream_after:
                self._cancel(record, holder)

        def on_result(future: Any, resent: bool = False) -> None:
            response = future.result()
            if finished.is_set():  # a re-sent request answered too: the same result
                return
            record.result_resent = resent
            record.result_at = time.monotonic()
            record.status = response.status
            result = response.result
            record.finish_reason, record.error, record.text = result.finish_reason, result.error, result.text
            stats = result.stats
            if stats.num_steps:
                record.step_ms = stats.verify_ms / stats.num_steps
            evaluated = stats.num_prompt_tokens - stats.num_prompt_tokens_reused
            if evaluated > 0 and stats.prompt_ms > 0:
                record.chunk_ms = stats.prompt_ms / math.ceil(evaluated / self.n_batch)
            if record.started_at and record.accepted_at:
                record.queue_wait = max(0.0, record.started_at - record.accepted_at)
            finished.set()

        def on_response(future: Any) -> None:
            handle = future.result()
            holder["handle"] = handle
            record.accepted_at = time.monotonic()
            record.accepted = bool(handle.accepted)
            if handle.accepted:
                if record.cancel_point == "response":  # in the goal-response callback itself
                    self._cancel(record, holder)
                handle.get_result_async().add_done_callback(_guarded(on_result))
            responded.set()

        record.sent_at = time.monotonic()
        future = self.action.send_goal_async(self.Goal(**fields), feedback_callback=_guarded(on_feedback))
        future.add_done_callback(_guarded(on_response))
        if not responded.wait(60.0):
            record.accepted, record.lost = None, True
            return
        if not record.accepted:
            return
        if record.cancel_point == "accepted":
            self._cancel(record, holder)
        elif record.cancel_point == "delay":
            time.sleep(rng.uniform(0.0, 1.5))
            self._cancel(record, holder)
        if not self._wait_result(finished, holder, on_result):
            record.lost = True
            return
        # feedback is a topic, the result a service: feedback may land after the result
        key = bytes(holder["handle"].goal_id.uuid)
        deadline = time.monotonic() + 2.0
        while True:
            with self.lock:
                record.streamed = "".join(self.streams.get(key, ()))
            if record.streamed == record.text or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        with self.lock:
            self.streams.pop(key, None)

    def _wait_result(self, finished: threading.Event, holder: Dict[str, Any],
                     on_result: Callable[..., None]) -> bool:
        """Wait up to --goal-timeout for the result; every --result-resend seconds without it, ask
        again (the server keeps a finished goal's result for queue.result_timeout, 60 s, and
        answers every pending request). rclpy's ActionClient drops a result response that arrives
        before get_result_async registered its request (ros2/rclpy#1123): a robot's client would
        ask again too. A goal is lost only if no request is ever answered."""
        deadline = time.monotonic() + self.args.goal_timeout
        while not finished.wait(max(0.0, min(self.args.result_resend, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return False
            holder["handle"].get_result_async().add_done_callback(
                _guarded(lambda future: on_result(future, resent=True)))
        return True

    def _cancel(self, record: GoalRecord, holder: Dict[str, Any]) -> None:
        handle = holder.get("handle")
        if handle is None or record.cancel_at:
            return
        record.cancel_at = time.monotonic()

        def on_cancel(future: Any) -> None:
            response = future.result()
            record.cancel_accepted = bool(response.goals_canceling)

        handle.cancel_goal_async().add_done_callback(_guarded(on_cancel))

    # parameters and lifecycle ---------------------------------------------------------------------
    def _flip_loop(self) -> None:
        rng = random.Random(self.args.seed + 7)
        valid = [("spec.mode", lambda: rng.choice(["off", "lookup", "auto"])),
                 ("spec.draft_max", lambda: rng.choice([1, 2, 4, 8, 16])),
                 ("spec.adaptive", lambda: rng.random() < 0.5),
                 ("spec.verification", lambda: rng.choice(["exact", "rejection"])),
                 ("feedback.min_period", lambda: rng.choice([0.0, 0.1])),
                 ("queue.max_depth", lambda: rng.choice([2, 4, 8]))]
        invalid = [("spec.mode", lambda: "hyperdrive"), ("spec.draft_max", lambda: 999),
                   ("spec.verification", lambda: "maybe"), ("spec.mode", lambda: "draft"),
                   ("generation.max_tokens", lambda: 10 ** 7),
                   ("target.n_ctx", lambda: 4096)]  # configure-time: refused while configured
        cycles = ["deactivate"] * self.args.cycles + ["cleanup"] * self.args.cleanup_cycles
        cycles += ["remote"] if self.remote is not None else []
        plan = cycle_plan(rng, cycles, self.args.goals)
        while not self.stop_event.wait(rng.uniform(*self.args.flip_period)):
            if plan and self.next_index >= plan[0][0]:
                self._cycle(plan.pop(0)[1])
                continue
            is_valid = rng.random() >= 0.2
            name, value_of = rng.choice(valid if is_valid else invalid)
            value = value_of()
            try:
                ok, reason = self._set(name, value)
            except RuntimeError as exc:
                ok, reason = False, f"no answer: {exc}"
            self.param_results.append({"name": name, "value": value, "valid": is_valid,
                                       "ok": ok, "reason": reason})
        for _, label in plan:  # cycles the goals finished too early for
            self._cycle(label)

    def _cycle(self, label: str) -> None:
        if label == "deactivate":
            self._transition("deactivate")
            time.sleep(0.3)
            self._transition("activate")
        elif label == "remote":
            self.remote.run()
        else:
            self.reconfigure({})

    def reconfigure(self, parameters: Dict[str, Any]) -> None:
        """Cleanup, set configure-time ``parameters``, configure, activate."""
        # cleanup destroys the action server: a goal request in flight then gets no response
        # at all (a client must time out), so the clients finish their goals first
        self.serving.clear()
        deadline = time.monotonic() + self.args.goal_timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self._transition("deactivate")
            self._transition("cleanup")
            for name, value in parameters.items():
                ok, reason = self._set(name, value)
                self.param_results.append({"name": name, "value": value, "valid": True,
                                           "ok": ok, "reason": reason})
            self._transition("configure")
            self._transition("activate")
            self.action.wait_for_server(timeout_sec=30.0)
            time.sleep(1.0)  # discovery of the new server's services
        finally:
            self.serving.set()

    def _golden(self) -> str:
        """The greedy output of a fixed goal, evaluated whole (prompt reuse off for it)."""
        self._set("generation.prompt_cache", False)
        try:
            record = GoalRecord(-1, "golden", invalid=False)
            self._run_goal(record, dict(GOLDEN), random.Random(0))
            return record.text if record.status == 4 else f"<status {record.status}: {record.error}>"
        finally:
            self._set("generation.prompt_cache", True)

    def _final_sigint(self) -> List[GoalRecord]:
        """Send goals, then SIGINT the server while they run and wait."""
        finals = [GoalRecord(self.args.goals + i, "final", invalid=False) for i in range(self.args.final_goals)]
        threads = []
        for record in finals:
            fields = dict(prompt=COMPLETION_PROMPTS[0], max_tokens=self.args.max_tokens, temperature=0.0)
            thread = threading.Thread(target=self._run_goal, args=(record, fields, random.Random(1)), daemon=True)
            thread.start()
            threads.append(thread)
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(r.accepted is None for r in finals):
            time.sleep(0.02)
        time.sleep(0.2)
        os.killpg(self.server.pid, signal.SIGINT)
        for thread in threads:
            thread.join(timeout=120)
        return finals

    # sampling and progress ------------------------------------------------------------------------
    def _done(self) -> int:
        with self.lock:
            return sum(1 for r in self.records if r.result_at or r.accepted is False or r.lost)

    def _sample_loop(self) -> None:
        """Every sample period until the server exits: its RSS, threads, open files, n-grams."""
        while self.server.poll() is None:
            sample = proc_sample(self.server.pid)
            if sample:
                self.samples.append(Sample(
                    time.monotonic() - self.t0, self._done(), sample["rss_mib"], int(sample["threads"]),
                    int(sample["open_files"]), self.ngrams, sample.get("rss_anon_mib", math.nan),
                    sample.get("rss_file_mib", math.nan),
                    self.serving.is_set() and not (self.remote is not None and self.remote.active)))
            deadline = time.monotonic() + self.args.sample_period
            while self.server.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)

    def _progress(self, final: bool = False) -> None:
        if self.args.no_progress:
            return
        done, total = self._done(), self.args.goals
        width = 30
        filled = int(width * done / max(1, total))
        rss = self.samples[-1].rss_mib if self.samples else math.nan
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} goals  "
                         f"RSS {rss:.0f} MiB" + ("\n" if final else ""))
        sys.stderr.flush()

    # report ---------------------------------------------------------------------------------------
    def _report(self, golden_start: str, golden_end: str, finals: List[GoalRecord], exit_status: int,
                seconds: float) -> Report:
        records = self.records + finals
        accepted = [r for r in records if r.accepted]
        lost = [r.index for r in records if r.accepted and not r.result_at]
        unanswered = [r.index for r in records if r.accepted is None]
        invalid_accepted = [r.kind for r in records if r.invalid and r.accepted]
        bad_cancels = [(r.index, r.cancel_point, r.status) for r in accepted
                       if r.cancel_accepted and r.status not in (4, 5)]  # SUCCEEDED, CANCELED
        mismatched = [(r.index, r.kind, r.streamed[:40], r.text[:40]) for r in accepted
                      if r.result_at and r.streamed != r.text]
        params_bad = [p for p in self.param_results
                      if (p["valid"] and not p["ok"]) or (not p["valid"] and (p["ok"] or not p["reason"]))]
        log = (self.out / "serve.log").read_text(errors="replace")
        rejections_logged = log.count("goal rejected:")
        rejected = sum(1 for r in records if r.accepted is False)
        report = Report(config={k: v for k, v in vars(self.args).items()})
        checks = report.checks
        checks["0 lost"] = {"pass": not lost, "detail": f"{len(accepted)} accepted, lost: {lost[:20]}"}
        checks["invalid goals refused"] = {
            "pass": not invalid_accepted,
            "detail": f"{sum(r.invalid for r in records)} invalid sent; accepted: {invalid_accepted[:10]}"}
        checks["rejections logged with a reason"] = {
            "pass": rejections_logged >= rejected,
            "detail": f"{rejected} rejected, {rejections_logged} 'goal rejected: <reason>' log lines"}
        checks["parameters"] = {"pass": not params_bad,
                                "detail": f"{len(self.param_results)} sets; wrong: {params_bad[:5]}"}
        checks["cancel accepted -> CANCELED"] = {
            "pass": not bad_cancels, "detail": f"violations (index, point, status): {bad_cancels[:10]}"}
        checks["streamed == result"] = {"pass": not mismatched, "detail": f"mismatches: {mismatched[:10]}"}
        checks["same greedy output at the end"] = {
            "pass": golden_start == golden_end and not golden_start.startswith("<"),
            "detail": f"start {golden_start[:60]!r} end {golden_end[:60]!r}"}
        checks["transitions"] = {"pass": all(t["ok"] for t in self.transitions),
                                 "detail": f"{len(self.transitions)} transitions"}
        checks["exit status 0"] = {"pass": exit_status == 0, "detail": f"exit status {exit_status}"}
        checks["dynamic cache valid"] = self._check_cache()
        if self.remote is not None:
            checks.update(self.remote.checks(records))
        report.metrics = self._metrics(records, seconds, rejected, log)
        m = report.metrics
        if self.remote is not None:
            m["remote_phase"] = self.remote.metrics()
        if self.args.max_rss_slope is not None:
            checks["RSS slope"] = {
                "pass": m["rss_slope_mib_per_1000_goals"] < self.args.max_rss_slope,
                "detail": f"{m['rss_slope_mib_per_1000_goals']:.2f} MiB per 1,000 goals after "
                          f"{self.args.warmup} goals (limit {self.args.max_rss_slope}); anonymous "
                          f"{m['rss_anon_slope_mib_per_1000_goals']:.2f}"}
        if self.args.cancel_bound:
            p99 = m["cancel_to_result_s"]["p99"] * 1000
            checks["cancel within a chunk + 2 steps"] = {
                "pass": p99 <= m["cancel_bound_ms"],
                "detail": f"p99 cancel-to-result {p99:.1f} ms; bound {m['cancel_bound_ms']:.1f} ms = "
                          f"chunk p99 {m['chunk_ms']['p99']:.1f} + 2 x step p99 {m['step_ms']['p99']:.1f}"}
        # Not a check of the server: rclpy's ActionClient can lose a goal response when the executor
        # handles it before send_goal_async registered the request (ros2/rclpy#1123, fixed upstream
        # in #1308 and its backports); the driver then logs "Ignoring unexpected goal response".
        report.metrics["goal_requests_unanswered"] = unanswered
        # the same race on the result request: answered only when asked again (see _wait_result)
        report.metrics["result_requests_unanswered"] = [r.index for r in records if r.result_resent]
        report.samples = [asdict(s) for s in self.samples]
        report.metrics["goal_records"] = [
            {k: v for k, v in asdict(r).items() if k not in ("streamed", "text")} for r in records]
        return report

    def _check_cache(self) -> Dict[str, Any]:
        path = self.overrides.get("lookup.dynamic_path", "")
        if not path:
            return {"pass": True, "detail": "no lookup.dynamic_path override: not checked"}
        from gemma_spec_ros.engine import learned_cache
        try:
            _, cache = learned_cache.read(os.path.expanduser(path))
        except Exception as exc:  # noqa: BLE001
            return {"pass": False, "detail": f"{path}: {exc}"}
        return {"pass": True, "detail": f"{path}: {len(cache)} n-grams"}

    def _metrics(self, records: List[GoalRecord], seconds: float, rejected: int, log: str) -> Dict[str, Any]:
        done = [r for r in records if r.result_at]
        latency = percentiles([r.result_at - r.sent_at for r in done])
        cancel = percentiles([r.result_at - r.cancel_at for r in done if r.cancel_at])
        queue = percentiles([r.queue_wait for r in done])
        warm = [s for s in self.samples if s.goals_done >= self.args.warmup and s.serving]
        per_goal = slope([s.goals_done for s in warm], [s.rss_mib for s in warm])
        per_second = slope([s.t for s in warm], [s.rss_mib for s in warm])
        anon = slope([s.goals_done for s in warm], [s.rss_anon_mib for s in warm])
        step, chunk = percentiles([r.step_ms for r in done]), percentiles([r.chunk_ms for r in done])
        statuses: Dict[str, int] = {}
        for r in done:
            statuses[r.finish_reason or "?"] = statuses.get(r.finish_reason or "?", 0) + 1
        return {
            "seconds": seconds, "goals": len(records), "accepted": sum(1 for r in records if r.accepted),
            "rejected": rejected, "finish_reasons": statuses,
            "cancels": sum(1 for r in records if r.cancel_at),
            "latency_s": latency, "queue_wait_s": queue, "cancel_to_result_s": cancel,
            "rss_mib_first": self.samples[0].rss_mib if self.samples else math.nan,
            "rss_mib_last": self.samples[-1].rss_mib if self.samples else math.nan,
            "rss_slope_mib_per_1000_goals": per_goal * 1000,
            "rss_slope_mib_per_hour": per_second * 3600,
            "rss_anon_slope_mib_per_1000_goals": anon * 1000,
            "rss_anon_mib_first": self.samples[0].rss_anon_mib if self.samples else math.nan,
            "rss_anon_mib_last": self.samples[-1].rss_anon_mib if self.samples else math.nan,
            "rss_file_mib_last": self.samples[-1].rss_file_mib if self.samples else math.nan,
            "step_ms": step, "chunk_ms": chunk, "cancel_bound_ms": chunk["p99"] + 2 * step["p99"],
            "threads_slope_per_1000_goals": slope([s.goals_done for s in warm], [s.threads for s in warm]) * 1000,
            "open_files_slope_per_1000_goals": slope([s.goals_done for s in warm], [s.open_files for s in warm]) * 1000,
            "dynamic_cache_ngrams_last": self.samples[-1].ngrams if self.samples else 0,
            "error_log_lines": sum(1 for line in log.splitlines() if "[ERROR]" in line or "[FATAL]" in line),
            "parameter_sets": len(self.param_results), "transitions": len(self.transitions),
        }


def render_markdown(report: Report) -> str:
    m = report.metrics
    lines = ["# gemma-spec-soak", "",
             f"{m['goals']} goals ({m['accepted']} accepted, {m['rejected']} rejected, {m['cancels']} "
             f"cancels) in {m['seconds']:.0f} s; {m['parameter_sets']} parameter sets, "
             f"{m['transitions']} transitions. Result: **{'PASS' if report.passed else 'FAIL'}**", "",
             "| check | result | detail |", "|---|---|---|"]
    for name, check in report.checks.items():
        lines.append(f"| {name} | {'PASS' if check['pass'] else 'FAIL'} | {check['detail']} |")
    lines += ["", "| measure | p50 | p95 | p99 | n |", "|---|---|---|---|---|"]
    for key, label in (("latency_s", "latency (s)"), ("queue_wait_s", "queue wait (s)"),
                       ("cancel_to_result_s", "cancel to result (s)"), ("step_ms", "target pass (ms)"),
                       ("chunk_ms", "prompt chunk (ms)")):
        p = m[key]
        lines.append(f"| {label} | {p['p50']:.3f} | {p['p95']:.3f} | {p['p99']:.3f} | {p['n']} |")
    lines += ["", "| resource | value |", "|---|---|",
              f"| RSS first / last (MiB) | {m['rss_mib_first']:.0f} / {m['rss_mib_last']:.0f} |",
              f"| RSS slope after warm-up (MiB per 1,000 goals) | {m['rss_slope_mib_per_1000_goals']:.2f} |",
              f"| RSS slope after warm-up (MiB per hour) | {m['rss_slope_mib_per_hour']:.2f} |",
              f"| anonymous RSS first / last (MiB) | {m['rss_anon_mib_first']:.0f} / {m['rss_anon_mib_last']:.0f} |",
              f"| anonymous RSS slope after warm-up (MiB per 1,000 goals) | "
              f"{m['rss_anon_slope_mib_per_1000_goals']:.2f} |",
              f"| file-backed RSS last (MiB; the model's mapped pages) | {m['rss_file_mib_last']:.0f} |",
              f"| threads slope (per 1,000 goals) | {m['threads_slope_per_1000_goals']:.2f} |",
              f"| open files slope (per 1,000 goals) | {m['open_files_slope_per_1000_goals']:.2f} |",
              f"| dynamic cache n-grams (last) | {m['dynamic_cache_ngrams_last']} |",
              f"| ERROR/FATAL log lines | {m['error_log_lines']} |",
              f"| goal requests without a response (client side, ros2/rclpy#1123) | "
              f"{len(m['goal_requests_unanswered'])} |",
              f"| result requests answered only when re-sent (client side, ros2/rclpy#1123) | "
              f"{len(m.get('result_requests_unanswered', []))} |",
              f"| finish reasons | {m['finish_reasons']} |"]
    return "\n".join(lines) + "\n"


def render_svg(samples: Sequence[Dict[str, Any]], width: int = 640, height: int = 240) -> str:
    """RSS (MiB) over time as a small dependency-free SVG line chart."""
    points = [(s["t"], s["rss_mib"]) for s in samples if not math.isnan(s["rss_mib"])]
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
    if len(points) < 2:
        return head + '<text x="10" y="20">fewer than 2 samples</text></svg>\n'
    t_max = max(t for t, _ in points) or 1.0
    low, high = min(r for _, r in points), max(r for _, r in points)
    span = (high - low) or 1.0
    def xy(t: float, r: float) -> str:
        return f"{40 + (width - 50) * t / t_max:.1f},{height - 30 - (height - 50) * (r - low) / span:.1f}"
    polyline = " ".join(xy(t, r) for t, r in points)
    return (head + f'<polyline fill="none" stroke="black" points="{polyline}"/>'
            f'<text x="5" y="15">RSS MiB {low:.0f}..{high:.0f}</text>'
            f'<text x="{width - 160}" y="{height - 8}">time 0..{t_max:.0f} s</text></svg>\n')


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    report = Soak(args).run()
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(dict(asdict(report), passed=report.passed), indent=1,
                                              default=str))
    (out / "soak.md").write_text(render_markdown(report))
    (out / "rss.svg").write_text(render_svg(report.samples))
    sys.stdout.write(render_markdown(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
