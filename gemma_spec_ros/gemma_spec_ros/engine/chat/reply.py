"""The model's reply, token by token: the text to stream, then the assistant message it makes.

:class:`ReplyStream` takes the generated tokens (a control token kept apart from text, so that text
which spells a marker is never read as one), streams the message's text as it settles (whole UTF-8
characters; text that may be the start of a stop string or of the call opener held back; nothing
of a call's own text, the text after a call streams again), and at the end reads the calls with the
turn's syntax and validates each one's arguments against its tool's JSON Schema (jsonschema, the
API of 3.2 and later). A call that does not parse, names a tool not offered this turn, or fails its
schema is left out of the message and said in :attr:`AssistantReply.error`.
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
    the text outside calls ends the text there (:attr:`stopped`: the caller ends the generation).
    The streamed text is the message's text: what a call's syntax reads as text (outside calls,
    before a call the reply ends inside), so that the stream and the message agree.
    """

    def __init__(self, vocab: Any, syntax: Optional[CallSyntax], stop: Sequence[str] = (),
                 conversation: Optional[Conversation] = None) -> None:
        self._vocab = vocab
        self._conversation = conversation  # whose reply this is (for final())
        self._syntax = syntax
        self._stop = tuple(stop)
        self._utf8 = Utf8Stream()
        self._pieces: List[List[Any]] = []  # [text, is_control], text runs merged
        self._held = ""  # text outside calls, not streamed yet
        self._call = ""  # the open call's text (tagged syntax: to find its closer)
        self.text = ""  # text streamed so far
        self.in_call = False  # a call is open: its text is not streamed
        self.calls_closed = 0  # calls opened and closed so far
        self._calls_at_stop = 0
        self.stopped = False
        self._pending = ""  # text released when a call opened, returned by the next push

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
        if self.stopped:
            return
        syntax = self._syntax
        if syntax is None:  # control tokens are not the message's text (nor the stream's)
            if not control:
                self._held += text
        elif syntax.opens_with_token:  # markers are control tokens; text between them is text
            if control and text == (syntax.closer if self.in_call else syntax.opener):
                self._toggle_call()
            elif not control and not self.in_call:
                self._held += text
        elif not control:  # markers are text: a call runs from its opener's text to its closer's
            if self.in_call:
                self._call += text
            else:
                self._held += text
            self._find_markers()

    def _find_markers(self) -> None:
        """Tagged syntax: open and close calls at their markers in the text taken so far."""
        syntax = self._syntax
        while not self.stopped:
            if not self.in_call:
                at = self._held.find(syntax.opener)
                if at < 0:
                    return
                self._held, self._call = self._held[:at], self._held[at + len(syntax.opener):]
                self._toggle_call()
            else:
                at = self._call.find(syntax.closer)
                if at < 0:
                    return
                self._held += self._call[at + len(syntax.closer):]
                self._call = ""
                self._toggle_call()

    def _toggle_call(self) -> None:
        """A call opens (the text held before it is the message's, up to a stop) or closes."""
        if self.in_call:
            self.in_call, self.calls_closed = False, self.calls_closed + 1
            return
        self._cut_at_stop()
        self.in_call = not self.stopped
        if self.in_call:  # the text before the call streams now, whole
            self._pending, self._held = self._pending + self._held, ""

    def _cut_at_stop(self) -> None:
        cut = min((i for i in (self._held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = self._held[:cut], True
            self._calls_at_stop = self.calls_closed

    def _release(self, final: bool) -> str:
        self._cut_at_stop()
        if final or self.stopped:
            out, self._held = self._held, ""
        else:
            keep = _prefix_tail(self._held, self._stop + self._opener_text())
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        out, self._pending = self._pending + out, ""
        self.text += out
        return out

    def _opener_text(self) -> Tuple[str, ...]:
        syntax = self._syntax
        return (syntax.opener,) if syntax is not None and not syntax.opens_with_token else ()

    def final(self, ended: str) -> Optional[AssistantReply]:
        """The turn's message at its end (after :meth:`flush`): :meth:`reply` of the conversation
        the stream was made for."""
        if self._conversation is None:
            raise ValueError("final() of a ReplyStream made without its conversation")
        return self.reply(self._conversation, ended)

    def reply(self, conversation: Conversation, ended: str) -> AssistantReply:
        """The turn's message (after :meth:`flush`): text, validated calls; ``ended`` is how the
        generation ended (a call cut by max_tokens is said so)."""
        if self._syntax is None:
            return AssistantReply((self.text if self.stopped else _text_of(self._pieces)).strip())
        parsed = self._syntax.parse(self.pieces)
        if self.stopped:  # the text ends at the stop; the calls closed before it are kept
            parsed = Parsed(self.text.strip(), parsed.calls[:self._calls_at_stop])
        return assistant_reply(conversation, parsed, ended)


def assistant_reply(conversation: Conversation, parsed: Parsed, ended: str = "stop") -> AssistantReply:
    """The message of a parsed reply: its text and the calls that validate; ``error`` says why a
    call was left out, that max_tokens cut one (``ended`` length), or that a turn which had to
    call a tool and stopped called none. A turn cut otherwise (cancelled, timeout) keeps the whole
    calls read before the cut, and its finish reason says why the rest is missing."""
    calls, errors = validated(conversation, parsed)
    if parsed.cut and ended == "length":
        errors.insert(0, f"max_tokens ran out inside a tool call ({parsed.error})")
    elif parsed.error and (ended == "stop" or not parsed.cut):  # a call cut by a cancel or a
        errors.insert(0, parsed.error)  # timeout: the turn's finish says why
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
