"""``gemma-spec-generate "prompt"``: send one Generate goal and print the text and the stats.

Like ``ros2 action send_goal --feedback /gemma_spec/generate ...``: with ``--stream`` the text is
printed as feedback arrives; otherwise once, from the result. The text goes to stdout, the goal's
status and the request's speculative-decoding stats to stderr. Ctrl-C cancels the goal.

Exit status: 0 succeeded, 1 no action server / timed out, 2 rejected, 3 aborted, 4 cancelled.
"""
from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from typing import Any, List, Optional, Sequence

import rclpy
from action_msgs.msg import GoalStatus
from gemma_spec_msgs.action import Generate
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from ..client import GenerateClient, NoAnswer, action_name
from ..node import NODE_NAME

EXIT_OK, EXIT_UNAVAILABLE, EXIT_REJECTED, EXIT_ABORTED, EXIT_CANCELLED = range(5)
_EXIT_BY_STATUS = {GoalStatus.STATUS_SUCCEEDED: EXIT_OK, GoalStatus.STATUS_ABORTED: EXIT_ABORTED,
                   GoalStatus.STATUS_CANCELED: EXIT_CANCELLED}
_STATUS_NAMES = {GoalStatus.STATUS_SUCCEEDED: "SUCCEEDED", GoalStatus.STATUS_ABORTED: "ABORTED",
                 GoalStatus.STATUS_CANCELED: "CANCELED"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gemma-spec-generate", description=__doc__.split("\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--spec-mode", default="", help="off|draft|lookup|draft+lookup|auto "
                        "(default: the node's spec.mode)")
    parser.add_argument("--stream", action="store_true", help="print text as feedback arrives")
    parser.add_argument("--max-tokens", type=int, default=0, help="0 = the node's default")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy; -1 = the node's generation.temperature")
    parser.add_argument("--top-p", type=float, default=0.0, help="0 = the node's default")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit; -1 = the node's generation.top_k")
    parser.add_argument("--seed", type=int, default=-1, help="-1 = random")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--system", default="", help="system prompt (with --chat)")
    parser.add_argument("--chat", action="store_true", help="wrap in the model's chat template")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds until the goal ends with finish_reason timeout and its text "
                             "so far; 0 = the node's generation.time_budget")
    parser.add_argument("--priority", type=int, default=0,
                        help="waiting goals start highest priority first (default 0)")
    parser.add_argument("--preempt", action="store_true",
                        help="stop a running goal of lower priority at its next step")
    parser.add_argument("--grammar", metavar="FILE", default="",
                        help="constrain the output to the GBNF grammar in FILE (llama.cpp's format)")
    parser.add_argument("--json-schema", metavar="FILE", default="",
                        help="constrain the output to JSON that follows the JSON Schema in FILE "
                             "(e.g. config/schemas/robot_plan.schema.json)")
    parser.add_argument("--node", default=NODE_NAME,
                        help="node name or full path; the action is <node>/generate")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the server and for the result")
    return parser.parse_args(argv)


def goal_from_args(args: argparse.Namespace) -> Generate.Goal:
    """The goal the arguments describe; OSError if a --grammar / --json-schema file cannot be read."""
    return Generate.Goal(prompt=args.prompt, system_prompt=args.system,
                         use_chat_template=args.chat, max_tokens=args.max_tokens,
                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         seed=args.seed, stop=list(args.stop), spec_mode=args.spec_mode,
                         time_budget=args.time_budget, priority=args.priority, preempt=args.preempt,
                         grammar=_read(args.grammar), json_schema=_read(args.json_schema))


def _read(path: str) -> str:
    if not path:
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def format_stats(result: Generate.Result) -> str:
    """The result's stats as a few ``key: value`` lines."""
    s = result.stats
    lines = [
        f"finish_reason: {result.finish_reason}" + (f" ({result.error})" if result.error else ""),
        f"tokens: prompt {result.prompt_tokens}, completion {result.completion_tokens}",
        f"spec_mode: {result.spec_mode} ({s.verification}), K {s.draft_max}",
        f"tau (mean acceptance length): {_num(s.mean_acceptance_length)}, acceptance rate: "
        f"{_num(s.acceptance_rate)} ({s.num_accepted_tokens}/{s.num_draft_tokens} in {s.num_drafts} drafts)",
        f"tokens/s: {_num(s.tokens_per_second)}, TTFT: {_num(s.time_to_first_token_ms)} ms, "
        f"measured speedup: {_num(s.measured_speedup)}",
    ]
    if s.num_grammar_draft_tokens or s.num_grammar_masks:
        lines.append(f"grammar: {s.num_grammar_accepted_tokens}/{s.num_grammar_draft_tokens} forced "
                     f"tokens accepted, {s.num_grammar_masks} rows masked, {_num(s.grammar_ms)} ms")
    return "\n".join(lines)


def _num(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3g}"


class _Printer:
    """Prints streamed text once: feedback first, then whatever the result adds. Feedback comes on
    the client's executor thread, the result on the main thread: a lock keeps them in that order,
    and feedback after the result is not printed."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.printed: List[str] = []
        self._lock = threading.Lock()
        self._done = False

    def feedback(self, message: Any) -> None:
        with self._lock:
            if self._done:
                return
            if message.feedback.queue_position:
                print(f"waiting: queue position {message.feedback.queue_position}", file=sys.stderr)
            if self.stream and message.feedback.text:
                self.printed.append(message.feedback.text)
                sys.stdout.write(message.feedback.text)
                sys.stdout.flush()

    def result(self, text: str) -> None:
        with self._lock:
            self._done = True
            done = "".join(self.printed)
            sys.stdout.write(text[len(done):] if text.startswith(done) else "\n" + text)
            sys.stdout.write("\n")
            sys.stdout.flush()


def send(client: GenerateClient, args: argparse.Namespace) -> int:
    """Send the goal, print, and return the exit status."""
    if not client.wait_for_server(args.timeout):
        print(f"no action server {action_name(args.node)} (is the node active?)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        goal = goal_from_args(args)
    except OSError as exc:
        print(f"cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_REJECTED
    printer = _Printer(args.stream)
    deadline = time.monotonic() + args.timeout
    try:
        run = client.send_goal(goal, timeout=args.timeout, on_feedback=printer.feedback)
    except NoAnswer:
        print("timed out sending the goal", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if not run.accepted:
        print("goal rejected (the node's log and /diagnostics 'last rejection' say why)",
              file=sys.stderr)
        return EXIT_REJECTED
    try:
        result = run.wait_result(timeout=max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        result = _cancelled(client, run)
    except NoAnswer:  # gave up waiting: do not leave the goal running on the node
        _cancel(client, run)
        print("timed out waiting for the result (goal cancelled)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if result is None:
        print("timed out waiting for the result (goal cancelled)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    printer.result(result.text)
    print(f"status: {_STATUS_NAMES.get(run.status, run.status)}", file=sys.stderr)
    print(format_stats(result), file=sys.stderr)
    return _EXIT_BY_STATUS.get(run.status, EXIT_ABORTED)


def _cancel(client: GenerateClient, run: Any) -> None:
    try:
        client.cancel(run, timeout=5.0)
    except NoAnswer:
        pass


def _cancelled(client: GenerateClient, run: Any) -> Optional[Generate.Result]:
    """Ctrl-C: cancel the goal, then its result (None if it does not come within 10 s)."""
    _cancel(client, run)
    try:
        return run.wait_result(timeout=10.0)
    except NoAnswer:
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(remove_ros_args(argv)[1:])
    # Ctrl-C must raise KeyboardInterrupt (to cancel the goal), not shut the context down.
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    # a one-goal command: no message history (GenerateClient keeps one for the node tests); a
    # relative --node resolves in this command's namespace, as ros2 action send_goal would
    client = GenerateClient(args.node, name="gemma_spec_generate", keep_history=False)
    try:
        return send(client, args)
    finally:
        client.close()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
