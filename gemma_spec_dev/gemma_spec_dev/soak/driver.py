"""The soak's driver: ``gemma-spec-serve`` as a subprocess, and the threads that drive it through
one :class:`~gemma_spec_ros.client.GenerateClient` like a busy robot (client threads sending goals
and cancelling some, a parameter thread setting parameters and running the lifecycle cycles, a
sampler reading /proc). :meth:`Soak.run` returns what it saw, a :class:`~.records.SoakRun`; the
report (:mod:`.report`) judges it."""
from __future__ import annotations

import argparse
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import rclpy
import yaml
from action_msgs.msg import GoalStatus
from gemma_spec_msgs.action import Generate, GenerateChat
from rclpy.qos import QoSProfile

from gemma_spec_ros.client import (GenerateClient, GoalRun, NoAnswer, action_name, chat_action_name, chat_goal,
                                   guarded, spec_status_name)

from . import remote_phase
from .fresh import PARAMETERS as FRESH_PARAMETERS
from .fresh import FreshCheck, Reference
from .procfs import proc_sample
from .records import GoalRecord, Sample, SoakRun
from .scenario import (BAD_DEFAULT_CONSTRAINTS, CANCEL_POINTS, COMPLETION_PROMPTS, GOLDEN,
                       INVALID_PARAMETER_SHARE, chat_goal as draw_chat_goal, cycle_plan, hostile_chat_goals,
                       hostile_goals, invalid_goals, malformed_chat_goals, parameter_draws, schema_goal, valid_goal)

#: The node's limits.* parameters the invalid goals are made to exceed (and the hostile ones to fill).
LIMITS = ("limits.max_tokens", "limits.max_prompt_tokens", "limits.max_prompt_bytes",
          "limits.max_stop_strings", "limits.max_stop_length", "limits.max_grammar_bytes")
#: The share of chat goals that are malformed (must be refused) and that attack the goal check.
MALFORMED_CHAT_SHARE = 0.12
HOSTILE_CHAT_SHARE = 0.04
#: Seconds the end of the run waits for /diagnostics to count the last rejections.
DIAGNOSTICS_WAIT = 10.0


def server_n_batch(params_files: Sequence[str], overrides: Dict[str, str]) -> int:
    """The server's ``target.n_batch``: an override, else the last params file naming it, else 512."""
    if "target.n_batch" in overrides:
        return int(overrides["target.n_batch"])
    n_batch = 512
    for path in params_files:
        with open(path) as fh:
            for section in (yaml.safe_load(fh) or {}).values():
                value = ((section or {}).get("ros__parameters") or {}).get("target", {}).get("n_batch")
                n_batch = int(value) if value else n_batch
    return n_batch


class Soak:
    """The server subprocess, the ROS client and the bookkeeping of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.records: List[GoalRecord] = []
        self.lock = threading.Lock()
        self.next_index = 0
        self.hostile_sent = 0  # the hostile goals go round their kinds in order (each one is sent)
        self.chat_sent = 0  # chat goals drawn: the first is malformed, the second hostile (each kind shows)
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
        self.client: Optional[GenerateClient] = None
        self.overrides = dict(item.split(":=", 1) for item in args.set)
        if args.chat_share > 0 and "chat.template_path" not in self.overrides:
            # the embedded base model has no chat template: the agent suite's (Gemma 3 turns, calls
            # as JSON in tags), as the tests give it
            from gemma_spec_dev.bench.agent_suite import TEMPLATE  # noqa: WPS433

            template = self.out / "chat-template.jinja"
            template.write_text(TEMPLATE)
            self.overrides["chat.template_path"] = str(template.resolve())
        self.fresh: Optional[FreshCheck] = None
        self.fresh_checks: List[Dict[str, Any]] = []
        self.n_batch = server_n_batch(args.params_file, self.overrides)
        self.remote = remote_phase.RemotePhase(self, args) if args.remote_phase > 0 else None

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
    def run(self) -> SoakRun:
        self.start_server()
        rclpy.init()
        path = f"/{self.args.node_name}"
        # a long run: no message history kept, only the latest status (the dynamic cache's n-grams)
        self.client = GenerateClient(path, name=f"{self.args.node_name}_driver", keep_history=False,
                                     threads=4)
        try:
            return self._drive(path)
        finally:
            if self.remote is not None:
                self.remote.stop()
            if self.server is not None and self.server.poll() is None:
                self.server.kill()
            self.client.close()
            rclpy.try_shutdown()

    def _drive(self, path: str) -> SoakRun:
        # rclpy's ActionClient drops feedback that arrives after the goal's result (it forgets the
        # goal's feedback callback then), and feedback is a topic, the result a service: read the
        # feedback topic directly to compare what the server streamed with the result
        self.streams: Dict[bytes, List[str]] = {}
        self.client.node.create_subscription(Generate.Impl.FeedbackMessage,
                                             f"{action_name(path)}/_action/feedback",
                                             self._on_raw_feedback, QoSProfile(depth=1000))
        self.client.node.create_subscription(GenerateChat.Impl.FeedbackMessage,
                                             f"{chat_action_name(path)}/_action/feedback",
                                             self._on_raw_feedback, QoSProfile(depth=1000))
        started = time.monotonic()
        if not self.client.wait_for_server(180.0):
            raise RuntimeError(f"no action server {action_name(path)} after 180 s (see {self.out}/serve.log)")
        self.limits = {name.split(".")[1]: value for name, value in self.client.get_parameters(LIMITS).items()}
        self.t0 = time.monotonic()
        golden_start = self._golden()
        if self.args.fresh_check:
            self.fresh = FreshCheck(self.client.get_parameters(FRESH_PARAMETERS))
            self._fresh_check("start")
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
        if self.fresh is not None:
            self._fresh_check("end")
            self.fresh.close()
        node_rejected = self._node_rejected()
        finals = self._final_sigint()
        sampler.join(timeout=self.args.sample_period + 5)
        exit_status = self.server.wait(timeout=120)
        self._progress(final=True)
        return SoakRun(records=self.records + finals, golden_start=golden_start, golden_end=golden_end,
                       exit_status=exit_status, seconds=time.monotonic() - started, samples=self.samples,
                       param_results=self.param_results, transitions=self.transitions,
                       serve_log=(self.out / "serve.log").read_text(errors="replace"), remote=self.remote,
                       node_rejected=node_rejected, fresh_checks=self.fresh_checks)

    def _node_rejected(self) -> int:
        """The count "requests rejected" on the node's /diagnostics once it counts every goal the clients saw
        rejected (or after DIAGNOSTICS_WAIT seconds: the last count it gave)."""
        with self.lock:
            seen = sum(1 for r in self.records if r.accepted is False)
        deadline = time.monotonic() + DIAGNOSTICS_WAIT
        count = -1
        while time.monotonic() < deadline:
            status = self.client.latest_status(spec_status_name(self.args.node_name))
            values = {kv.key: kv.value for kv in status.values} if status is not None else {}
            count = int(values.get("requests rejected", -1))
            if count >= seen:
                break
            time.sleep(0.2)
        return count

    def model_path(self) -> str:
        """The node's target.model_path, for the remote phase's server."""
        return os.path.expanduser(self.client.get_parameters(["target.model_path"])["target.model_path"])

    def _set(self, name: str, value: Any) -> Tuple[bool, str]:
        [result] = self.client.set_parameters(**{name: value})
        return result.successful, result.reason

    def _transition(self, label: str) -> bool:
        started = time.monotonic()
        ok = self.client.transition(label)
        self.transitions.append({"transition": label, "ok": bool(ok), "seconds": time.monotonic() - started})
        return ok

    def _ensure_active(self) -> None:
        state = self.client.state()
        if state == "unconfigured":
            self._transition("configure")
            state = self.client.state()
        if state == "inactive":
            self._transition("activate")

    def _on_raw_feedback(self, msg: Any) -> None:
        with self.lock:
            self.streams.setdefault(bytes(msg.goal_id.uuid), []).append(msg.feedback.text)

    def _ngrams(self) -> int:
        """The dynamic cache's n-grams on the node's latest status (the last number it gave)."""
        self.ngrams = int(self._status_value("dynamic cache n-grams", self.ngrams))
        return self.ngrams

    def _conversations_mib(self) -> float:
        """The conversation snapshots' MiB on the node's latest status (the last number it gave):
        memory bounded by chat.conversation_cache_mb, which the RSS slope is read beside."""
        self.snapshots_mib = self._status_value("conversations MiB", getattr(self, "snapshots_mib", math.nan))
        return self.snapshots_mib

    def _status_value(self, key: str, last: float) -> float:
        status = self.client.latest_status(spec_status_name(self.args.node_name))
        for kv in status.values if status is not None else ():
            if kv.key == key:
                try:
                    return float(kv.value)
                except ValueError:
                    pass
        return last

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
            record, fields = self._draw_goal(rng, index, invalid)
            if not record.invalid:  # the report checks that each result comes within its budget
                fields["time_budget"] = record.time_budget = self.args.goal_budget
            if self.remote is not None and self.remote.active:
                record.remote = True
                if not record.invalid:  # the phase checks its goals against its own budget
                    fields["time_budget"] = record.time_budget = self.remote.budget
            with self.lock:
                self.records.append(record)
                self.in_flight += 1
            try:
                self._run_goal(record, fields, rng)
            finally:
                with self.lock:
                    self.in_flight -= 1
            if record.accepted is False and not (record.invalid or record.hostile):
                # a valid goal refused (queue full, node inactive): a client retries later, as a
                # planner would; without a pause the goal count would be spent in rejections
                # whenever the node is inactive (a rejection takes ~2 ms)
                time.sleep(rng.uniform(0.1, 0.5))
            self._progress()

    def _draw_goal(self, rng: random.Random, index: int,
                   invalid: List[Tuple[str, Dict[str, Any]]]) -> Tuple[GoalRecord, Dict[str, Any]]:
        """The next goal of a client: a chat turn (``--chat-share``: valid, malformed or hostile),
        invalid, hostile (their kinds in turn; none during the remote phase), constrained by a
        schema, or another valid one (which may get a cancel point)."""
        # chat turns go to the local engine only: the remote phase's llama-server has no template
        if rng.random() < self.args.chat_share and not (self.remote is not None and self.remote.active):
            return self._draw_chat_goal(rng, index)
        if rng.random() < self.args.invalid_share:
            kind, fields = rng.choice(invalid)
            return GoalRecord(index, kind, invalid=True), fields
        # not to a remote server: its own grammar engine is not the node's to bound
        remote = self.remote is not None and self.remote.active
        if rng.random() < self.args.hostile_share and not remote:
            hostile = hostile_goals(self.limits, self.args.max_tokens)
            with self.lock:
                kind, fields = hostile[self.hostile_sent % len(hostile)]
                self.hostile_sent += 1
            record = GoalRecord(index, kind, invalid=False, hostile=True)
        elif rng.random() < self.args.schema_share:
            kind, fields = schema_goal(rng)
            record = GoalRecord(index, kind, invalid=False, json_schema=fields["json_schema"])
        else:
            kind, fields = valid_goal(rng, self.limits, self.args.max_tokens)
            record = GoalRecord(index, kind, invalid=False)
        if rng.random() < self.args.cancel_share:
            record.cancel_point = rng.choice(CANCEL_POINTS)
        return record, dict(fields)

    def _draw_chat_goal(self, rng: random.Random, index: int) -> Tuple[GoalRecord, Dict[str, Any]]:
        with self.lock:
            nth, self.chat_sent = self.chat_sent, self.chat_sent + 1
        roll = (0.0, MALFORMED_CHAT_SHARE)[nth] if nth < 2 else rng.random()
        if roll < MALFORMED_CHAT_SHARE:
            kind, fields = rng.choice(malformed_chat_goals(self.limits))
            return GoalRecord(index, kind, invalid=True, chat=True), dict(fields)
        if roll < MALFORMED_CHAT_SHARE + HOSTILE_CHAT_SHARE:
            kind, fields = rng.choice(hostile_chat_goals(self.limits))
            return GoalRecord(index, kind, invalid=False, hostile=True, chat=True), dict(fields, max_tokens=8)
        kind, fields = draw_chat_goal(rng)
        record = GoalRecord(index, kind, invalid=False, chat=True, tools=fields["tools"],
                            tool_choice=fields["tool_choice"])
        if rng.random() < self.args.cancel_share:
            record.cancel_point = rng.choice(CANCEL_POINTS)
        return record, dict(fields)

    def _run_goal(self, record: GoalRecord, fields: Dict[str, Any], rng: random.Random) -> None:
        """Send one goal, cancel it at its cancel point, wait for its result, and write down what
        came back (a goal without a goal response or without a result is ``lost``)."""
        feedback_count = 0
        stream_after = rng.randint(1, 6)
        holder: Dict[str, GoalRun] = {}  # the run, once accepted (the hooks run before send_goal returns)

        def on_feedback(msg: Any) -> None:
            nonlocal feedback_count
            feedback_count += 1
            if msg.feedback.queue_position == 0 and not record.started_at:
                record.started_at = time.monotonic()
            if record.cancel_point == "stream" and feedback_count == stream_after:
                self._cancel(record, holder.get("run"))

        def on_accepted(run: GoalRun) -> None:
            holder["run"] = run
            if record.cancel_point == "response":  # in the goal-response callback itself
                self._cancel(record, run)

        record.sent_at = time.monotonic()
        try:
            goal = chat_goal(fields) if record.chat else Generate.Goal(**fields)
            run = self.client.send_goal(goal, timeout=60.0, on_feedback=on_feedback, on_accepted=on_accepted)
        except NoAnswer:
            record.accepted, record.lost = None, True
            return
        record.accepted_at, record.accepted = run.accepted_at, run.accepted
        record.response_lost = bool(getattr(run, "response_lost", False))
        if not record.accepted:
            return
        if record.cancel_point == "accepted":
            self._cancel(record, run)
        elif record.cancel_point == "delay":
            time.sleep(rng.uniform(0.0, 1.5))
            self._cancel(record, run)
        try:
            result = run.wait_result(self.args.goal_timeout, resend_after=self.args.result_resend)
        except NoAnswer:
            record.lost = True
            return
        self._write_result(record, run, result)
        # feedback is a topic, the result a service: feedback may land after the result
        key = bytes(run.handle.goal_id.uuid)
        deadline = time.monotonic() + 2.0
        while True:
            with self.lock:
                record.streamed = "".join(self.streams.get(key, ()))
            if record.streamed_matches() or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        with self.lock:
            self.streams.pop(key, None)

    def _write_result(self, record: GoalRecord, run: GoalRun, result: Any) -> None:
        record.result_resent, record.result_at, record.status = run.result_resent, run.result_at, run.status
        record.finish_reason, record.error = result.finish_reason, result.error
        if record.chat:
            record.text = result.message.content
            record.tool_calls = [(call.name, call.arguments) for call in result.message.tool_calls]
        else:
            record.text = result.text
        stats = result.stats
        if stats.num_steps:
            record.step_ms = stats.verify_ms / stats.num_steps
        evaluated = stats.num_prompt_tokens - stats.num_prompt_tokens_reused
        if evaluated > 0 and stats.prompt_ms > 0:
            record.chunk_ms = stats.prompt_ms / math.ceil(evaluated / self.n_batch)
        if record.started_at and record.accepted_at:
            record.queue_wait = max(0.0, record.started_at - record.accepted_at)

    def _cancel(self, record: GoalRecord, run: Optional[GoalRun]) -> None:
        """Cancel the goal once, without waiting (also called from the client's callbacks)."""
        if run is None or run.handle is None or record.cancel_at:
            return
        record.cancel_at = time.monotonic()

        def on_cancel(future: Any) -> None:
            record.cancel_accepted = bool(future.result().goals_canceling)

        run.cancel_async().add_done_callback(guarded(on_cancel, "gemma-spec-soak"))

    # parameters and lifecycle ---------------------------------------------------------------------
    def _flip_loop(self) -> None:
        rng = random.Random(self.args.seed + 7)
        valid, invalid = parameter_draws(rng)
        cycles = ["deactivate"] * self.args.cycles + ["cleanup"] * self.args.cleanup_cycles
        cycles += ["remote"] if self.remote is not None else []
        plan = cycle_plan(rng, cycles, self.args.goals)
        first = list(BAD_DEFAULT_CONSTRAINTS)  # each once, early: a short run sets them too
        while not self.stop_event.wait(rng.uniform(*self.args.flip_period)):
            if first:  # before any cycle: a short run may have time for little else
                name, value = first.pop(0)
                self._set_and_note(name, value, valid=False)
                continue
            if plan and self.next_index >= plan[0][0]:
                self._cycle(plan.pop(0)[1])
                continue
            is_valid = rng.random() >= INVALID_PARAMETER_SHARE
            name, value_of = rng.choice(valid if is_valid else invalid)
            self._set_and_note(name, value_of(), is_valid)
        for _, label in plan:  # cycles the goals finished too early for
            self._cycle(label)

    def _set_and_note(self, name: str, value: Any, valid: bool) -> None:
        try:
            ok, reason = self._set(name, value)
        except NoAnswer as exc:
            ok, reason = False, f"no answer: {exc}"
        self.param_results.append({"name": name, "value": value, "valid": valid, "ok": ok, "reason": reason})

    def _cycle(self, label: str) -> None:
        if label == "deactivate":
            self._transition("deactivate")
            time.sleep(0.3)
            self._transition("activate")
        elif label == "remote":
            self.remote.run()
            return
        else:
            self.reconfigure({})
        if self.fresh is not None:
            self._fresh_check(f"after {label}")

    def _fresh_check(self, when: str) -> None:
        """The node's answers to the reference requests against the fresh engine's (soak/fresh.py),
        sent while the clients go on (the node serves them beside the workload)."""
        self.fresh_checks.append(self.fresh.check(self._ask, when))

    def _ask(self, reference: Reference) -> Tuple[bool, str]:
        """One reference request to the node: (answered, the text or what went wrong)."""
        try:
            goal = chat_goal(reference.fields) if reference.chat else Generate.Goal(**reference.fields)
            for _ in range(20):  # refused while the queue is full: a client tries again
                run = self.client.send_goal(goal, timeout=60.0)
                if run.accepted:
                    break
                time.sleep(0.5)
            else:
                return False, "rejected 20 times"
            result = run.wait_result(self.args.goal_timeout, resend_after=self.args.result_resend)
        except NoAnswer as exc:
            return False, str(exc)
        if run.status != GoalStatus.STATUS_SUCCEEDED:
            return False, f"status {run.status}: {result.error}"
        return True, result.message.content if reference.chat else result.text

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
            self.client.wait_for_server(30.0)
            time.sleep(1.0)  # discovery of the new server's services
        finally:
            self.serving.set()

    def _golden(self) -> str:
        """The greedy output of a fixed goal, evaluated whole (prompt reuse off for it)."""
        self._set("generation.prompt_cache", False)
        try:
            record = GoalRecord(-1, "golden", invalid=False)
            self._run_goal(record, dict(GOLDEN), random.Random(0))
            if record.status == GoalStatus.STATUS_SUCCEEDED:
                return record.text
            return f"<status {record.status}: {record.error}>"
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
                    int(sample["open_files"]), self._ngrams(), sample.get("rss_anon_mib", math.nan),
                    sample.get("rss_file_mib", math.nan),
                    self.serving.is_set() and not (self.remote is not None and self.remote.active),
                    self._conversations_mib()))
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
