"""``gemma-spec-generate "prompt"``: send one Generate goal and print the text and the stats.

Like ``ros2 action send_goal --feedback /gemma_spec/generate ...``: with ``--stream`` the text is
printed as feedback arrives; otherwise once, from the result. The text goes to stdout, the goal's
status and the request's speculative-decoding stats to stderr. Ctrl-C cancels the goal.

``gemma-spec-generate --chat FILE.json``: one chat turn (a GenerateChat goal on ``~/generate_chat``)
of the conversation in FILE, OpenAI's shape: ``{"messages": [...], "tools": [...], "tool_choice":
..., "parallel_tool_calls": ...}``. The conversation is checked here first (a refusal says why), the
assistant's message is printed to stdout as one JSON object in the same shape (append it to
``messages`` for the next turn), streamed text (``--stream``), status and stats to stderr.

Exit status: 0 succeeded, 1 no action server / timed out, 2 rejected, 3 aborted, 4 cancelled.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import rclpy
from action_msgs.msg import GoalStatus
from gemma_spec_msgs.action import Generate, GenerateChat
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from ..client import GenerateClient, NoAnswer, action_name, chat_action_name, chat_goal
from ..engine.chat.conversation import Conversation, conversation_from_json
from ..engine.modes import SPEC_MODES
from ..node import NODE_NAME

EXIT_OK, EXIT_UNAVAILABLE, EXIT_REJECTED, EXIT_ABORTED, EXIT_CANCELLED = range(5)
_EXIT_BY_STATUS = {GoalStatus.STATUS_SUCCEEDED: EXIT_OK, GoalStatus.STATUS_ABORTED: EXIT_ABORTED,
                   GoalStatus.STATUS_CANCELED: EXIT_CANCELLED}
_STATUS_NAMES = {GoalStatus.STATUS_SUCCEEDED: "SUCCEEDED", GoalStatus.STATUS_ABORTED: "ABORTED",
                 GoalStatus.STATUS_CANCELED: "CANCELED"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gemma-spec-generate", description=__doc__.split("\n")[0])
    parser.add_argument("prompt", nargs="?", default="", help="the prompt (not with --chat)")
    parser.add_argument("--spec-mode", default="", choices=("", *SPEC_MODES), metavar="MODE",
                        help=f"{' | '.join(SPEC_MODES)} (default: the node's spec.mode)")
    parser.add_argument("--stream", action="store_true", help="print text as feedback arrives")
    parser.add_argument("--max-tokens", type=int, default=0, help="0 = the node's default")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy; -1 = the node's generation.temperature")
    parser.add_argument("--top-p", type=float, default=0.0, help="0 = the node's default")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit; -1 = the node's generation.top_k")
    parser.add_argument("--seed", type=int, default=-1,
                        help="sampler seed; -1 = the node's generation.seed (its default, -1, draws a random seed)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--system", default="", help="system prompt (with --chat-template)")
    parser.add_argument("--chat-template", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--chat", metavar="FILE.json", default="",
                        help="send one chat turn of the conversation in FILE (OpenAI's messages, tools, "
                             "tool_choice, parallel_tool_calls) to <node>/generate_chat")
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
    args = parser.parse_args(argv)
    if bool(args.chat) == bool(args.prompt):
        parser.error("give a prompt, or --chat FILE.json (not both)")
    return args


def goal_from_args(args: argparse.Namespace) -> Any:
    """The goal the arguments describe (a GenerateChat goal with --chat); OSError if a file cannot
    be read, ValueError (with the reason) if the --chat file is not a valid conversation."""
    settings = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=list(args.stop), spec_mode=args.spec_mode,
                    time_budget=args.time_budget, priority=args.priority, preempt=args.preempt,
                    grammar=_read(args.grammar), json_schema=_read(args.json_schema))
    if args.chat:
        return chat_goal({**chat_fields(read_conversation(args.chat)), **settings})
    return Generate.Goal(prompt=args.prompt, system_prompt=args.system,
                         use_chat_template=args.chat_template, **settings)


def read_conversation(path: str) -> Conversation:
    """The conversation in a --chat file, checked as the node checks it (ValueError: why not)."""
    try:
        data = json.loads(_read(path))
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object with \"messages\"")
    return conversation_from_json(data)


def chat_fields(conversation: Conversation) -> Dict[str, Any]:
    """A conversation as GenerateChat goal fields."""
    messages = [{"role": m.role, "content": m.content, "name": m.name, "tool_call_id": m.tool_call_id,
                 "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]}
                for m in conversation.messages]
    tools = json.dumps([tool.as_openai() for tool in conversation.tools]) if conversation.tools else ""
    return {"messages": messages, "tools": tools, "tool_choice": conversation.tool_choice,
            "parallel_tool_calls": conversation.parallel_tool_calls}


def message_json(result: GenerateChat.Result) -> str:
    """The result's assistant message as OpenAI writes one (for the next turn's ``messages``)."""
    message = result.message
    entry: Dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.tool_calls:
        entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in message.tool_calls]
    return json.dumps(entry, ensure_ascii=False)


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

    def __init__(self, stream: bool, out: Any = None) -> None:
        self.stream = stream
        self.out = out if out is not None else sys.stdout  # where streamed text goes
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
                self.out.write(message.feedback.text)
                self.out.flush()

    def result(self, text: str) -> None:
        with self._lock:
            self._done = True
            done = "".join(self.printed)
            sys.stdout.write(text[len(done):] if text.startswith(done) else "\n" + text)
            sys.stdout.write("\n")
            sys.stdout.flush()


def send(client: GenerateClient, args: argparse.Namespace) -> int:
    """Send the goal, print, and return the exit status."""
    chat = bool(args.chat)
    if not client.wait_for_server(args.timeout, chat=chat):
        name = chat_action_name(args.node) if chat else action_name(args.node)
        print(f"no action server {name} (is the node active?)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        goal = goal_from_args(args)
    except OSError as exc:
        print(f"cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_REJECTED
    except ValueError as exc:
        print(f"not sent: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    printer = _Printer(args.stream, sys.stderr if chat else None)
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
    if chat:
        if args.stream:
            print(file=sys.stderr)
        print(message_json(result))
    else:
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
