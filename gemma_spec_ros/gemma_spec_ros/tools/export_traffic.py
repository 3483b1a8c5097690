"""``gemma-spec-export-traffic``: the node's request log as a conversation dataset for training a
draft head (EAGLE-3) on the target's own replies to the robot's own prompts.

    gemma-spec-export-traffic LOG -o OUT.jsonl [--format specforge|sharegpt|openai-messages]
        [--tool-calls auto|structured|text] [--chat-only] [--skip-raw] [--min-turns N]
        [--skip-length] [--include-errors] [--dedupe] [--force]

LOG is the node's ``traffic.log_path`` (its rotated file ``LOG.1`` is read first, then LOG). Each
served request becomes one JSON line; the assistant turns are the target's replies as the node served
them. Formats:

- ``specforge`` (default): SGLang SpecForge's conversation format, ``{"id", "conversations":
  [{"role": "system"|"user"|"assistant"|"tool", "content"}...], "tools": [...]}``. vLLM's speculators
  (``speculators prepare-data``) reads the same file: a local JSONL with a ``conversations`` column of
  role/content messages and a ``tools`` column. An assistant's calls are OpenAI's ``tool_calls``
  (``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments as JSON text), a tool
  result a ``tool`` message with its ``tool_call_id``: both trainers keep these fields and hand the
  messages and the row's tools to the target's own chat template (``apply_chat_template``), which
  writes the calls in the target's syntax, as the node's template did.
- ``sharegpt``: ``{"id", "conversations": [{"from": "system"|"human"|"gpt", "value"}...]}``, which
  SpecForge's and speculators' readers also take (``from``/``value`` normalised to role/content).
- ``openai-messages``: ``{"id", "messages": [...], "tools": [...]}``, the chat shape of HF datasets
  and TRL.

``--tool-calls``: ``structured`` keeps calls and tool results as fields (above); ``text`` writes the
conversation as the node writes it for a template without tools (Gemma 3's): the tools described in
the system message, each call as ``<tool_call>{"name", "arguments"}</tool_call>`` in the assistant's
text, tool results as user turns, runs of one role joined (engine/chat/template.py's
``fallback_messages``): plain system/user/assistant turns that alternate, which any reader takes.
``auto`` (default): ``text`` for sharegpt (ShareGPT has no tool fields), ``structured`` otherwise.

A ``~/generate`` request becomes a single user turn (its system prompt a system message) and the
reply an assistant turn. A request sent without the chat template (``use_chat_template`` false: a
completion-style prompt the target read raw) is exported the same way, although the trainer will
wrap it in the chat template; ``--skip-raw`` leaves those out.

Left out, always: turns whose reply left a call out (a call that did not parse or failed its schema:
the message is not what the target wrote; ``--include-errors`` keeps them), empty replies, records
read twice, and conversations a trainer's reader would refuse: roles other than system (first only),
user, assistant and tool, a first turn that is not the user's, an assistant after an assistant, a
tool result after anything but a call or a result, a last turn that is not the assistant's. Filters:
``--chat-only`` (``~/generate_chat`` turns only), ``--min-turns N`` (at least N assistant turns, the
reply included), ``--skip-length`` (replies cut by max_tokens), ``--dedupe`` (one row per identical
conversation). The counts of what was left out go to stderr.

OUT is written atomically; an existing OUT is refused without ``--force``. Exit status 1 with one line
on stderr when the log cannot be read (a file that is not the node's log is refused, untouched).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import os
import sys
from typing import Any, Counter, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..engine.files import write_atomically_from
from ..engine.request_log import ROTATED_SUFFIX, ReadCounts, TrafficLogError, read_records

PROG = "gemma-spec-export-traffic"
FORMATS: Tuple[str, ...] = ("specforge", "sharegpt", "openai-messages")
TOOL_CALLS: Tuple[str, ...] = ("auto", "structured", "text")
#: ShareGPT's speakers.
SHAREGPT_FROM: Dict[str, str] = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
#: Which role each role may follow (SpecForge's GeneralParser: a tool message follows an assistant's
#: call or another result, an assistant message follows the user or a result).
FOLLOWS: Dict[str, Tuple[str, ...]] = {"user": ("assistant", "tool"), "assistant": ("user", "tool"),
                                       "tool": ("assistant", "tool")}
_MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")


@dataclasses.dataclass(frozen=True)
class Options:
    """What to export, and how (the command's options)."""

    format: str = "specforge"
    tool_calls: str = "auto"
    chat_only: bool = False
    skip_raw: bool = False
    min_turns: int = 1
    skip_length: bool = False
    include_errors: bool = False
    dedupe: bool = False

    @property
    def structured(self) -> bool:
        """Calls and tool results as fields (else written into the text)."""
        if self.tool_calls == "auto":
            return self.format != "sharegpt"
        return self.tool_calls == "structured"


def conversation_of(record: Mapping[str, Any], structured: bool) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(messages in OpenAI's shape, the reply last; tools) of one record."""
    if record["kind"] == "generate":
        system = [{"role": "system", "content": record["system_prompt"]}] if record.get("system_prompt") else []
        return system + [{"role": "user", "content": record["prompt"]},
                         {"role": "assistant", "content": record["text"]}], []
    messages = [_clean(m) for m in record["messages"]] + [_clean(record["message"])]
    tools = list(record.get("tools") or [])
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if structured or not uses_tools:
        return messages, tools
    return as_text(messages, tools, record.get("tool_choice") or "auto",
                   bool(record.get("parallel_tool_calls"))), []


def _clean(message: Mapping[str, Any]) -> Dict[str, Any]:
    return {key: message[key] for key in _MESSAGE_KEYS if message.get(key) or key in ("role", "content")}


def as_text(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], tool_choice: str,
            parallel: bool) -> List[Dict[str, Any]]:
    """The conversation as the node writes it for a template without tools (``fallback_messages``
    with the tagged-JSON call syntax): plain role/content turns."""
    from ..engine.chat.conversation import conversation_from_json
    from ..engine.chat.syntax import TAGGED_JSON_CALLS
    from ..engine.chat.template import fallback_messages

    conversation = conversation_from_json({"messages": list(messages)})
    conversation = dataclasses.replace(conversation, tools=_tools(json.dumps(list(tools))),
                                       tool_choice=tool_choice, parallel_tool_calls=parallel)
    return [{"role": m.role, "content": m.content} for m in fallback_messages(conversation, TAGGED_JSON_CALLS)]


@functools.lru_cache(maxsize=256)
def _tools(text: str) -> Tuple[Any, ...]:
    from ..engine.chat.conversation import parse_tools

    return parse_tools(text)  # checked once per set of tools (jsonschema's meta-schema check)


def check_conversation(messages: Sequence[Mapping[str, Any]]) -> str:
    """'' if the trainers' readers take ``messages`` (SpecForge's GeneralParser, speculators'
    renderer), else why not.

    >>> check_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    ''
    >>> check_conversation([{"role": "assistant", "content": "yo"}])
    "the first turn after the system prompt is the assistant's, not the user's"
    """
    if not messages:
        return "no messages"
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", *FOLLOWS):
            return f"message {i} has the role {role!r}"
        if not isinstance(message.get("content"), str):
            return f"message {i} has no text"
        if role == "system" and i > 0:
            return "a system message after the first"
    body = list(messages[1:] if messages[0]["role"] == "system" else messages)
    if not body or body[0]["role"] != "user":
        return f"the first turn after the system prompt is the {body[0]['role'] if body else 'none'}'s, not the user's"
    for before, message in zip(body, body[1:]):
        if before["role"] not in FOLLOWS[message["role"]]:
            return f"a {message['role']} message follows a {before['role']} message"
        if message["role"] == "tool" and before["role"] == "assistant" and not before.get("tool_calls"):
            return "a tool result follows an assistant message without calls"
    last = body[-1]
    if last["role"] != "assistant":
        return "the last turn is not the assistant's"
    if not last["content"].strip() and not last.get("tool_calls"):
        return "an empty reply"
    return ""


def row_of(record: Mapping[str, Any], options: Options) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the dataset row of a record, '') or (None, why it is left out)."""
    chat = record["kind"] == "chat"
    if options.chat_only and not chat:
        return None, "~/generate requests (--chat-only)"
    if options.skip_raw and not chat and not record.get("use_chat_template"):
        return None, "prompts sent without the chat template (--skip-raw)"
    if options.skip_length and record.get("finish_reason") == "length":
        return None, "replies cut by max_tokens (--skip-length)"
    if record.get("reply_error") and not options.include_errors:
        return None, "replies that left a call out (--include-errors keeps them)"
    try:
        messages, tools = conversation_of(record, options.structured)
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"records whose conversation does not read as one ({type(exc).__name__})"
    reason = check_conversation(messages)
    if reason:
        return None, f"conversations a trainer would refuse: {reason}"
    turns = sum(1 for m in messages if m["role"] == "assistant")
    if turns < options.min_turns:
        return None, f"conversations of fewer than {options.min_turns} assistant turns (--min-turns)"
    row: Dict[str, Any] = {"id": record_id(record)}
    if options.format == "openai-messages":
        row["messages"] = messages
    elif options.format == "sharegpt":
        row["conversations"] = [_sharegpt(m) for m in messages]
    else:
        row["conversations"] = messages
    if options.structured and (tools or options.format == "specforge"):
        row["tools"] = tools
    return row, ""


def _sharegpt(message: Mapping[str, Any]) -> Dict[str, Any]:
    out = {"from": SHAREGPT_FROM[message["role"]], "value": message["content"]}
    out.update({k: v for k, v in message.items() if k not in ("role", "content")})
    return out


def record_id(record: Mapping[str, Any]) -> str:
    """The id of a record: the one the node gave it (the same record read twice, while the log
    rotated, has the same), else a digest of its content.

    >>> record_id({"id": "5f2a9c", "kind": "generate"})
    'traffic-5f2a9c'
    """
    if isinstance(record.get("id"), str) and record["id"]:
        return "traffic-" + record["id"]
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return "traffic-" + digest.hexdigest()[:20]


def export(log: str, out: str, options: Options) -> Tuple[int, Counter[str], ReadCounts]:
    """Write the dataset of ``log`` to ``out`` (atomically): (rows written, why records were left
    out, what the read skipped). Raises TrafficLogError, OSError."""
    counts = ReadCounts()
    skipped: Counter[str] = collections.Counter()
    written = [0]

    def lines() -> Iterator[bytes]:
        seen_records, seen_rows = set(), set()
        for record in read_records(log, counts):
            row, reason = row_of(record, options)
            if row is None:
                skipped[reason] += 1
                continue
            if row["id"] in seen_records:
                skipped["records read twice"] += 1
                continue
            seen_records.add(row["id"])
            if options.dedupe:
                key = json.dumps({k: v for k, v in row.items() if k != "id"}, sort_keys=True)
                if key in seen_rows:
                    skipped["identical conversations (--dedupe)"] += 1
                    continue
                seen_rows.add(key)
            written[0] += 1
            yield (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")

    write_atomically_from(out, lines())
    return written[0], skipped, counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write the node's request log (traffic.log_path) as a conversation "
        "dataset for a draft-head trainer (SpecForge, speculators).")
    parser.add_argument("log", metavar="LOG", help="the request log (LOG.1, its rotated file, is read too)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="the dataset to write")
    parser.add_argument("--format", choices=FORMATS, default="specforge",
                        help="specforge (default; speculators reads it too), sharegpt or openai-messages")
    parser.add_argument("--tool-calls", choices=TOOL_CALLS, default="auto",
                        help="structured: OpenAI tool_calls and tool messages; text: written into the "
                        "turns as the node does for a template without tools; auto (default): text for "
                        "sharegpt, else structured")
    parser.add_argument("--chat-only", action="store_true", help="only ~/generate_chat turns")
    parser.add_argument("--skip-raw", action="store_true",
                        help="leave out ~/generate prompts sent without the chat template")
    parser.add_argument("--min-turns", type=int, default=1, metavar="N",
                        help="only conversations of at least N assistant turns, the reply included (default 1)")
    parser.add_argument("--skip-length", action="store_true", help="leave out replies cut by max_tokens")
    parser.add_argument("--include-errors", action="store_true",
                        help="keep chat turns whose reply left a call out (not what the target wrote)")
    parser.add_argument("--dedupe", action="store_true", help="one row per identical conversation")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    options = Options(args.format, args.tool_calls, args.chat_only, args.skip_raw, args.min_turns,
                      args.skip_length, args.include_errors, args.dedupe)
    try:
        reason = _check_output(args.log, args.output, args.force)
        if reason:
            raise ValueError(reason)
        written, skipped, counts = export(args.log, args.output, options)
    except (TrafficLogError, OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print(f"{PROG}: wrote {written} conversations ({args.format}) to {args.output}", file=sys.stderr)
    for reason, count in sorted(skipped.items()):
        print(f"  left out {count}: {reason}", file=sys.stderr)
    if counts.torn:
        print(f"  ignored {counts.torn} torn last line(s) (a write a crash cut short)", file=sys.stderr)
    if counts.damaged:
        print(f"  ignored {counts.damaged} line(s) that are no record", file=sys.stderr)
    return 0


def _check_output(log: str, output: str, force: bool) -> str:
    """'' if ``output`` may be written, else why not (never the log itself; an existing file only
    with ``--force``)."""
    real = os.path.realpath(output)
    if real in (os.path.realpath(log), os.path.realpath(log + ROTATED_SUFFIX)):
        return f"{output} is the request log itself: give another output"
    if os.path.lexists(output) and not force:
        return f"{output} exists: give --force to replace it"
    if os.path.lexists(output) and not os.path.isfile(output):
        return f"{output} is not a regular file"
    return ""


if __name__ == "__main__":
    sys.exit(main())
