"""A request's prompt made ready for the loop: the one place that tells a chat turn from a prompt.

    chat = ChatLayer(target, template)        # the chat template (a file's, or the model's at the
                                              # first turn) and the vocabulary's chat view
    prepared = prepare_prompt(request, target, chat)
    prepared.tokens, prepared.constraint      # what the loop decodes, what constrains the output
    prepared.text_stream(target, stop)        # tokens -> text -> (a turn's) final message
    prepared.before_prompt_pass(kv, conversations) / after_prompt_pass(kv, conversations)

The loop (engine.py, steps.py, slots.py) holds a prepared prompt and never asks which kind it is:
a :class:`~.request.PlainPrompt` (text, or text in the model's own template) or a chat turn
(:class:`~.chat.turn.ChatTurn`: a conversation rendered by its template, the reply's constraint and
call syntax). Preparing runs in the caller's thread (a goal callback), under the engine's vocabulary
lock.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from .chat.template import ChatTemplate, ChatVocab
from .chat.turn import ChatTurn, model_template, prepare_turn
from .grammar.matcher import compiled_constraint
from .llama.chat_prompt import chat_tokens
from .request import GenerationRequest, PlainPrompt

Prepared = Union[PlainPrompt, ChatTurn]


class ChatLayer:
    """What chat turns are prepared with: the template (``template``: a file's, loaded by the
    engine; else the model's own, read at the first turn) and the vocabulary's chat view (made at
    the first turn)."""

    def __init__(self, target: Any, template: Optional[ChatTemplate] = None) -> None:
        self._target = target
        self._template = template
        self._vocab: Optional[ChatVocab] = None

    def turn(self, request: GenerationRequest) -> ChatTurn:
        """The request's conversation, prepared as a chat turn; a ValueError / TemplateError says why not."""
        if self._template is None:
            self._template = model_template(self._target)
        if self._vocab is None:
            self._vocab = ChatVocab(self._target)
        return prepare_turn(request.conversation, self._template, self._vocab, request.grammar, request.json_schema)

    def close(self) -> None:
        """The model goes: its vocabulary view with it."""
        self._vocab = None


def prepare_prompt(request: GenerationRequest, target: Any, chat: ChatLayer) -> Prepared:
    """The request's prompt ready for the loop: a chat turn's, or the prompt's tokens (in the
    model's own template when it asks for it: turns come from the template, never from the
    content) with its compiled constraint (ValueError where it does not compile)."""
    if request.conversation:
        return chat.turn(request)
    if request.use_chat_template:
        tokens = chat_tokens(target, request.prompt, request.system_prompt)
    else:
        tokens = target.tokenize(request.plain_prompt, add_special=True, parse_special=False)
    return PlainPrompt(tuple(tokens), compiled_constraint(request.grammar, request.json_schema))


__all__ = ["ChatLayer", "Prepared", "prepare_prompt"]
