"""One generation as the engine sees it: the request, its counted prompt, the steps it yields.

A request is a prompt (text, optionally in the model's chat template), or a chat turn: a
``conversation`` (engine/chat/: messages, tools, tool_choice) whose next assistant message the
engine generates. Both go through the same loop; a chat turn's counted prompt carries the turn as
the engine prepared it (its tokens, its compiled constraint, its call syntax), and its last step
the assistant message read from the reply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union

from .config import SamplingParams
from .modes import check_mode_name
from .stats import SpecStats

if TYPE_CHECKING:  # the chat layer is imported where a chat turn is served (it needs numpy, jinja2)
    from .chat.conversation import Conversation
    from .chat.reply import AssistantReply
    from .chat.turn import ChatTurn
    from .detokenize import TextAssembler
    from .grammar.matcher import Constraint


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. ``spec_mode`` None means the engine's current mode."""

    prompt: str = ""  # required unless conversation is set
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    system_prompt: str = ""
    use_chat_template: bool = False
    stop: Tuple[str, ...] = ()
    spec_mode: Optional[str] = None
    #: seconds from the start of generate() after which the request ends with finish_reason
    #: ``timeout`` and its text so far (checked at step boundaries); 0 = no limit
    time_budget: float = 0.0
    #: keep the KV cache of the previous request's common prefix and evaluate only the rest
    #: (bit-identical with F16/F32 weights; quantized weights may differ after a near-tie, since
    #: the batch shapes change); False = evaluate the whole prompt from an empty cache
    reuse_prompt: bool = True
    #: constrained output (engine/grammar/matcher.py, llguidance): a GBNF grammar (llama.cpp's format, rule
    #: ``root``), or a JSON Schema (text); at most one of the two
    grammar: str = ""
    json_schema: str = ""
    #: a chat turn: the conversation whose next assistant message to generate (prompt,
    #: system_prompt and use_chat_template stay empty: the messages are the prompt, in the chat
    #: template); grammar / json_schema only where no tools are offered
    conversation: Optional["Conversation"] = None

    def __post_init__(self) -> None:
        if self.conversation is not None:
            if self.prompt or self.system_prompt or self.use_chat_template:
                raise ValueError("a chat turn carries its messages in conversation: prompt, system_prompt "
                                 "and use_chat_template stay empty")
        elif not self.prompt:
            raise ValueError("prompt is empty")
        if self.grammar and self.json_schema:
            raise ValueError("grammar and json_schema are both set: give at most one of the two")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if not math.isfinite(self.time_budget) or self.time_budget < 0:
            raise ValueError(f"time_budget={self.time_budget}: must be finite and >= 0 (0 = none)")
        if self.spec_mode is not None:
            check_mode_name(self.spec_mode)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def plain_prompt(self) -> str:
        """The text of a request without the chat template: the system prompt, a blank line, the
        prompt (the local engine tokenizes it; a remote server gets it as its raw prompt).

        >>> GenerationRequest("Hi", system_prompt="Be brief.").plain_prompt
        'Be brief.\\n\\nHi'
        """
        if self.system_prompt:
            return self.system_prompt + "\n\n" + self.prompt
        return self.prompt


@dataclass(frozen=True)
class PlainPrompt:
    """A prompt (text, or text in the model's own chat template) made ready for the loop: its
    tokens and its compiled constraint. The loop asks a prompt, never which kind it is (a chat turn
    answers the same: engine/chat/turn.py ``ChatTurn``):

    - :meth:`text_stream`: what turns its generated tokens into streamed text, and at the end into
      the final message (``final(finish)``: None for a prompt, the assistant message of a turn);
    - :meth:`before_prompt_pass` / :meth:`after_prompt_pass`: around the prompt pass, with prompt
      reuse on (a turn restores and keeps its conversation's KV: engine/conversations.py).
    """

    tokens: Tuple[int, ...]
    constraint: Optional["Constraint"] = None

    def text_stream(self, target: Any, stop: Sequence[str]) -> "TextAssembler":
        from .detokenize import TextAssembler  # noqa: WPS433

        return TextAssembler(target, stop)

    def before_prompt_pass(self, kv: Any, conversations: Any) -> None:
        """Nothing: the sequence's own cells are what prompt reuse keeps."""

    def after_prompt_pass(self, kv: Any, conversations: Any) -> None:
        """Nothing to keep beside the sequence."""


@dataclass(frozen=True)
class CountedPrompt:
    """A request's prompt as one engine counted it (``count_prompt``).

    ``tokens`` are the token ids from an engine that tokenizes here (None from one that sends text,
    whose ``n_tokens`` may be an estimate). Handed back to that engine's ``generate`` after its
    ``check_request`` passed, they spare tokenizing and checking the request a second time.
    """

    n_tokens: int
    tokens: Optional[Tuple[int, ...]] = None
    #: the prompt as this engine prepared it for its loop: a :class:`PlainPrompt`, or a chat turn
    #: (engine/chat/turn.py ``ChatTurn``: its tokens are ``tokens``, with the reply's constraint and
    #: call syntax); None from a remote engine
    prepared: Optional[Union[PlainPrompt, "ChatTurn"]] = None
    #: the request's constraint compiled and checked (a chat turn's: its reply's), None without one
    #: or from a remote engine: the request starts with it, not compiled again
    constraint: Optional["Constraint"] = None


@dataclass(frozen=True)
class Step:
    """What one engine step produced. The last step of a generation has ``finish_reason`` set."""

    tokens: Tuple[int, ...]  # tokens emitted at this step (may be empty, e.g. held by a stop string)
    text: str  # new text since the previous step: whole UTF-8 characters, stop strings excluded
    stats: SpecStats  # the request's stats so far (a snapshot; safe to keep)
    spec_mode: str  # mode in effect at this step ("auto:lookup" style when auto chose)
    draft_max: int  # K in effect at this step
    finish_reason: Optional[str] = None  # stop | length | timeout | cancelled on the last step
    #: on the last step, what the finish reason alone does not say (e.g. max_tokens ran out before
    #: the request's grammar was complete: the text is not a whole match); else ''
    detail: str = ""
    #: on the last step of a chat turn, the assistant message read from the reply (its text and
    #: its validated tool calls); else None. The steps' ``text`` is that message's text, streamed
    reply: Optional["AssistantReply"] = None
