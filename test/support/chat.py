"""Chat fixtures shared by the chat tests: the planner's skills as tools, conversations, a greedy
constrained decode of a turn on a real model (the engine's loop serves turns: test_chat_engine.py;
the chat layer's own tests drive the model directly), and the template file given to the embedded
base model, which has none of its own."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Sequence

import numpy as np

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.chat import (AssistantReply, ChatMessage, ChatTurn, ChatVocab, Conversation,
                                        ReplyStream, ToolCall, model_template, parse_tools)
from gemma_spec_ros.engine.grammar.matcher import GrammarVocab
from gemma_spec_ros.engine.sampling import sample_constrained
from gemma_spec_ros.engine.config import ModelConfig

#: A robot planner's skills, as OpenAI function tools. Bounded strings and enums: a random-weight
#: model writing free text inside a string would not stop within a test's token budget.
SKILLS: List[dict] = [
    {"type": "function", "function": {
        "name": "move_to", "description": "Drive the base to a named place of the map.",
        "parameters": {"type": "object", "properties": {
            "place": {"type": "string", "enum": ["dock", "kitchen", "lab"]},
            "speed": {"type": "number", "enum": [0.2, 0.5, 1.0], "description": "m/s"}},
            "required": ["place"]}}},
    {"type": "function", "function": {
        "name": "pick", "description": "Pick an object up with the arm.",
        "parameters": {"type": "object", "properties": {
            "object": {"type": "string", "maxLength": 8},
            "careful": {"type": "boolean"}},
            "required": ["object", "careful"]}}},
    {"type": "function", "function": {
        "name": "say", "description": "Speak a short sentence.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
                       "required": ["text"]}}},
]
SKILLS_JSON = json.dumps(SKILLS)


class ChatModel:
    """A loaded GGUF with what the chat layer uses of it: its vocabulary, its own template, and
    llguidance's tokenizer of it."""

    def __init__(self, path: Path, n_ctx: int = 4096) -> None:
        self.backend = LlamaModel(ModelConfig(str(path), n_ctx=n_ctx))
        self.vocab = ChatVocab(self.backend)
        self.template = model_template(self.backend)
        self.grammar_vocab = GrammarVocab.of(self.backend)

    def plain(self, text: str) -> List[int]:
        """``text`` tokenized with llama.cpp's special-token parsing (what a naive caller sends)."""
        return self.backend.tokenize(text, add_special=True, parse_special=True)

    def decode(self, turn: ChatTurn, max_tokens: int = 96, stop: Sequence[str] = ()) -> "Decoded":
        return decode_turn(self.backend, self.vocab, self.grammar_vocab, turn, max_tokens, stop)

    def close(self) -> None:
        self.backend.close()


def planner_conversation(tool_choice: str = "auto", parallel: bool = False, *extra: ChatMessage) -> Conversation:
    """A planner's conversation: a system prompt, a request, an earlier call and its result."""
    messages = (ChatMessage("system", "You are the task planner of a mobile robot."),
                ChatMessage("user", "Bring the cup from the kitchen."),
                ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "move_to", '{"place": "kitchen"}'),)),
                ChatMessage("tool", '{"arrived": true}', tool_call_id="call_1"),
                ChatMessage("user", "Now pick it up."), *extra)
    return Conversation(messages, parse_tools(SKILLS_JSON), tool_choice, parallel)


@dataclass
class Decoded:
    """One turn decoded: its tokens, the text streamed, how it ended (stop | length), the stream."""

    tokens: List[int]
    streamed: str
    ended: str
    stream: ReplyStream

    def reply(self, conversation: Conversation) -> AssistantReply:
        return self.stream.reply(conversation, self.ended)


def decode_turn(backend: Any, vocab: Any, grammar_vocab: GrammarVocab, turn: ChatTurn,
                max_tokens: int = 96, stop: Sequence[str] = ()) -> Decoded:
    """Greedy decoding of ``turn`` under its constraint, until end-of-generation, a stop string or
    ``max_tokens``."""
    backend.clear()
    rows = backend.decode(list(turn.tokens), [len(turn.tokens) - 1])
    grammar = grammar_vocab.start(turn.constraint) if turn.constraint is not None else None
    stream = ReplyStream(vocab, turn.syntax, stop)
    tokens: List[int] = []
    streamed = ""
    ended = "length"
    for _ in range(max_tokens):
        row = rows[-1]
        token = (sample_constrained(lambda r: int(np.argmax(r)), row, grammar.allowed().bits, greedy=True)
                 if grammar is not None else int(np.argmax(row)))
        if backend.is_eog(token):
            ended = "stop"
            break
        if grammar is not None:
            grammar.accept(token)
        tokens.append(token)
        streamed += stream.push([token])
        if stream.stopped:
            ended = "stop"
            break
        rows = backend.decode([token], [0])
    return Decoded(tokens, streamed + stream.flush(), ended, stream)


def embedded_template_file(folder: Path) -> Path:
    """A chat template file for the embedded Gemma 3 270M base model (it has no
    tokenizer.chat_template): the agent suite's (Gemma 3 turns, calls as JSON in <tool_call> tags),
    for the node's chat.template_path."""
    from gemma_spec_dev.bench.agent_suite import TEMPLATE  # noqa: WPS433

    path = Path(folder) / "embedded-chat-template.jinja"
    path.write_text(TEMPLATE)
    return path


def control_count(tokens: Sequence[int], token: int) -> int:
    return sum(1 for t in tokens if t == token)
