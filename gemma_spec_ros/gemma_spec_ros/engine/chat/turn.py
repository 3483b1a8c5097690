"""One turn made ready for the model: the prompt's tokens, the constraint on the reply, its syntax.

    template = model_template(backend)                 # or ChatTemplate(text, "FILE")
    turn = prepare_turn(conversation, template, vocab)  # TemplateError / ValueError: refuse the goal
    turn.tokens, turn.text                             # the templated conversation
    turn.constraint                                    # llguidance's grammar of the reply, or None
    stream = ReplyStream(vocab, turn.syntax, stop)     # tokens -> text -> AssistantReply (reply.py)

The constraint, by ``tool_choice`` (:mod:`.syntax`): ``required`` or a name, the reply is calls of
the offered tools; ``auto``, free text until a call opens, then the call's grammar; ``none`` (or no
tools), the request's own grammar / json_schema if it has one, else nothing. A grammar or schema
together with tools is refused: the tools' grammar is the reply's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from ..grammar.matcher import Constraint, compiled_constraint
from .conversation import Conversation
from .reply import ReplyStream
from .syntax import CallSyntax
from ..files import read_regular_file
from .template import ChatTemplate, ChatVocab, TemplateError


@dataclass(frozen=True)
class ChatTurn:
    """A conversation rendered and tokenized, with what constrains and reads its reply; it answers
    the loop as a plain prompt does (engine/request.py ``PlainPrompt``)."""

    conversation: Conversation
    tokens: Tuple[int, ...]
    text: str
    syntax: Optional[CallSyntax]  # None: no tools this turn (the reply is text)
    constraint: Optional[Constraint]
    vocab: Optional[ChatVocab] = None  # the vocabulary's chat view the turn was prepared with

    def text_stream(self, target: Any, stop: Sequence[str]) -> ReplyStream:
        """The reply's stream: text until a call opens, the assistant message at the end."""
        return ReplyStream(self.vocab, self.syntax, stop, self.conversation)

    def before_prompt_pass(self, kv: Any, conversations: Any) -> None:
        """The conversation's KV back, if another request ran since its last turn and a kept
        snapshot serves more of this prompt (engine/conversations.py)."""
        conversations.restore_for(kv, self.tokens)

    def after_prompt_pass(self, kv: Any, conversations: Any) -> None:
        """This prompt's KV kept: the conversation's next turn starts with it."""
        conversations.save(kv)


def model_template(backend: Any) -> ChatTemplate:
    """The chat template in the model's GGUF (``tokenizer.chat_template``); TemplateError without."""
    source = backend.chat_template()
    if not source:
        raise TemplateError(f"model {backend.path} has no chat template (tokenizer.chat_template): "
                            "give one with the chat template file setting")
    return ChatTemplate(source, f"the chat template of {backend.path}")


#: The largest chat template file read (a model's template is a few KiB; Gemma 4's ~15 KiB).
MAX_TEMPLATE_BYTES = 256 << 10


def template_file(path: str) -> ChatTemplate:
    """The chat template in the file at ``path`` (a Jinja template, as ``tokenizer.chat_template``
    holds one); TemplateError if it is not a regular file of at most :data:`MAX_TEMPLATE_BYTES`
    (never a hang on a FIFO nor an unbounded read of a device), is not UTF-8, does not compile or
    does not render the conversation's ``messages`` (any other text file would become every chat
    turn's prompt)."""
    try:
        source = read_regular_file(path, MAX_TEMPLATE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"cannot read the chat template file {path}: {exc}") from None
    template = ChatTemplate(source, f"the chat template file {path}")
    if not template.reads_messages:
        raise TemplateError(f"the chat template file {path} does not render `messages`: not a chat template")
    return template


def prepare_turn(conversation: Conversation, template: ChatTemplate, vocab: ChatVocab,
                 grammar: str = "", json_schema: str = "") -> ChatTurn:
    """The turn's tokens, syntax and constraint; TemplateError / ValueError with the reason."""
    check_constraint(conversation, grammar, json_schema)
    tools = conversation.offered
    tokens, text = template.prompt_tokens(conversation, vocab)
    syntax = template.call_syntax if tools else None
    lark = ("" if syntax is None
            else syntax.grammar(tools, conversation.must_call, conversation.parallel_tool_calls, vocab.control_id))
    return ChatTurn(conversation, tuple(tokens), text, syntax, compiled_constraint(grammar, json_schema, lark=lark),
                    vocab)


def check_constraint(conversation: Conversation, grammar: str, json_schema: str) -> None:
    """ValueError if a grammar or schema comes with tools offered (the tools' grammar is the reply's);
    the rule of every engine, the remote one too."""
    if conversation.offered and (grammar or json_schema):
        raise ValueError("grammar / json_schema constrain a reply without tools: send them with no tools "
                         "or with tool_choice none (the tools' own grammar constrains a reply with calls)")


__all__ = ["ChatTurn", "check_constraint", "model_template", "prepare_turn", "template_file"]
