"""The model's reply, token by token: the text to stream, then the assistant message it makes.

:class:`ReplyStream` takes the generated tokens (a control token kept apart from text, so that text
which spells a marker is never read as one), streams the message's text as it settles (whole UTF-8
characters; text that may be the start of a stop string or of the call opener held back; nothing
once a call opens), and at the end reads the calls with the turn's syntax and validates each one's
arguments against its tool's JSON Schema (jsonschema, the API of 3.2 and later). A call that does
not parse, names a tool not offered this turn, or fails its schema is left out of the message and
said in :attr:`AssistantReply.error`.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from ..detokenize import Utf8Stream
from .conversation import Conversation, ToolCall
from .syntax import CallSyntax, Parsed, Piece


@dataclass(frozen=True)
class AssistantReply:
    """The assistant message of a turn: its text and its validated calls; ``error`` says what was
    left out and why ('' when nothing was)."""

    content: str
    tool_calls: Tuple[ToolCall, ...] = ()
    error: str = ""

    def finish_reason(self, ended: str) -> str:
        """The turn's finish reason: ``tool_calls`` for a turn that stopped with calls, else how
        the generation ended (stop, length, timeout, ...)."""
        return "tool_calls" if self.tool_calls and ended == "stop" else ended


class ReplyStream:
    """One turn's generated tokens -> streamed text -> :class:`AssistantReply` (module docstring).

    ``syntax`` None: no tools this turn, everything is text. ``stop``: stop strings; one found in
    the text before any call ends the text there (:attr:`stopped`: the caller ends the generation).
    """

    def __init__(self, vocab: Any, syntax: Optional[CallSyntax], stop: Sequence[str] = ()) -> None:
        self._vocab = vocab
        self._syntax = syntax
        self._stop = tuple(stop)
        self._utf8 = Utf8Stream()
        self._pieces: List[List[Any]] = []  # [text, is_control], text runs merged
        self._held = ""  # text before any call, not streamed yet
        self.text = ""  # text streamed so far
        self.in_call = False  # a call was opened: nothing more is streamed
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> str:
        """Take generated tokens; return the text that can be streamed now."""
        for token in tokens:
            if self._vocab.is_control(token):
                self._add(self._utf8.flush(), False)
                self._add(self._vocab.token_text(token), True)
            else:
                self._add(self._utf8.push(self._vocab.token_bytes(token)), False)
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended: the text still held back."""
        self._add(self._utf8.flush(), False)
        return self._release(final=True)

    @property
    def pieces(self) -> List[Piece]:
        return [(text, control) for text, control in self._pieces]

    def _add(self, text: str, control: bool) -> None:
        if not text:
            return
        if self._pieces and not control and not self._pieces[-1][1]:
            self._pieces[-1][0] += text
        else:
            self._pieces.append([text, control])
        if self.in_call or self.stopped:
            return
        syntax = self._syntax
        if control:
            if syntax is not None and syntax.opens_with_token and text == syntax.opener:
                self._open_call(len(self._held))
        else:
            self._held += text
            if syntax is not None and not syntax.opens_with_token and syntax.opener in self._held:
                self._open_call(self._held.find(syntax.opener))

    def _open_call(self, at: int) -> None:
        """A call opens at ``at`` of the held text: what comes before it is text (up to a stop)."""
        self._held = self._held[:at]
        self._cut_at_stop()
        self.in_call = not self.stopped

    def _cut_at_stop(self) -> None:
        cut = min((i for i in (self._held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = self._held[:cut], True

    def _release(self, final: bool) -> str:
        self._cut_at_stop()
        if final or self.in_call or self.stopped:
            out, self._held = self._held, ""
        else:
            keep = _prefix_tail(self._held, self._stop + self._opener_text())
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self.text += out
        return out

    def _opener_text(self) -> Tuple[str, ...]:
        syntax = self._syntax
        return (syntax.opener,) if syntax is not None and not syntax.opens_with_token else ()

    def reply(self, conversation: Conversation, ended: str) -> AssistantReply:
        """The turn's message (after :meth:`flush`): text, validated calls; ``ended`` is how the
        generation ended (a call cut by max_tokens is said so)."""
        if self._syntax is None or self.stopped:
            content = self.text if self.stopped else _text_of(self._pieces)
            return AssistantReply(content.strip())
        return assistant_reply(conversation, self._syntax.parse(self.pieces), ended)


def assistant_reply(conversation: Conversation, parsed: Parsed, ended: str = "stop") -> AssistantReply:
    """The message of a parsed reply: its text and the calls that validate; ``error`` says why a
    call was left out, that max_tokens cut one (``ended`` length), or that a turn which had to
    call a tool and stopped called none. A turn cut otherwise (cancelled, timeout) keeps the whole
    calls read before the cut, and its finish reason says why the rest is missing."""
    calls, errors = validated(conversation, parsed)
    if parsed.error and ended == "length":
        errors.insert(0, f"max_tokens ran out inside a tool call ({parsed.error})")
    elif parsed.error and ended == "stop":  # else the turn was cut (cancelled, timeout): its finish says so
        errors.insert(0, parsed.error)
    if conversation.must_call and not calls and not errors and ended in ("stop", "length"):
        errors.append(f"tool_choice {conversation.tool_choice} but the reply calls no tool"
                      + (" (max_tokens ran out first)" if ended == "length" else ""))
    return AssistantReply(parsed.content, calls, "; ".join(errors))


def validated(conversation: Conversation, parsed: Parsed) -> Tuple[Tuple[ToolCall, ...], List[str]]:
    """The parsed calls that name an offered tool and whose arguments follow its schema, each with
    a new id; and a reason for each call left out."""
    import jsonschema  # noqa: WPS433

    offered = {tool.name: tool for tool in conversation.offered}
    calls: List[ToolCall] = []
    errors: List[str] = []
    for name, arguments in parsed.calls:
        tool = offered.get(name)
        if tool is None:
            errors.append(f"the reply calls {name!r}, which is not a tool offered this turn")
            continue
        schema = dict(tool.parameters)
        try:
            error = jsonschema.exceptions.best_match(
                jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments))
        except Exception as exc:  # noqa: BLE001  a schema jsonschema cannot apply (an unresolvable
            # $ref, recursion too deep): the call is left out with the reason, the turn ends normally
            errors.append(f"the arguments of {name!r} could not be checked against its schema: "
                          f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        if error is not None:
            where = "/".join(str(p) for p in error.path)
            errors.append(f"the arguments of {name!r} do not follow its schema: {error.message}"
                          + (f" (at {where})" if where else ""))
            continue
        try:
            calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, RecursionError) as exc:  # arguments nested too deep to read back
            errors.append(f"the arguments of {name!r} cannot be kept: {str(exc)[:120]}")
    return tuple(calls), errors


def _text_of(pieces: Sequence[Sequence[Any]]) -> str:
    return "".join(text for text, control in pieces if not control)


def _prefix_tail(text: str, words: Sequence[str]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of one of ``words``.

    >>> _prefix_tail("say <tool_c", ["<tool_call>"]), _prefix_tail("done.", ["<tool_call>"])
    (7, 0)
    """
    keep = 0
    for word in words:
        for n in range(min(len(word) - 1, len(text)), keep, -1):
            if text.endswith(word[:n]):
                keep = n
                break
    return keep


__all__ = ["AssistantReply", "ReplyStream", "assistant_reply", "validated"]
