"""The soak's fresh-engine check: after any workload, the node still writes the model's own text.

A fresh engine of the node's configuration (its model, context, batch and chat template; loaded in
the soak's own process, ROS-free) answers the reference requests (scenario.REFERENCE_PROMPTS and
REFERENCE_CHATS: greedy, ``off``, prompt reuse as the node is configured) once, at the start.
After each lifecycle cycle and at the end the soak sends the same requests to the node and compares
each answer with the fresh engine's text. Several requests at once and the default build's batch
shapes move logits by float rounding (docs/design.md, "Numerical facts"), so an answer may part from
the fresh text at a near-tie: where the fresh engine's logit of the token the node's text goes on
with is within :data:`NEAR_TIE` of its own choice's. Anywhere else a difference fails the check:
the node answered with text that is not the model's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from gemma_spec_ros.engine.chat import ChatMessage, Conversation, ToolCall, parse_tools
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.request import GenerationRequest

from .scenario import REFERENCE_CHATS, REFERENCE_PROMPTS

#: The largest gap between two logits that counts as a tie. With flash attention on (the embedded
#: profile) and Q4_K_M weights on the default build, decoding beside two other sequences moved the
#: gap between a reference's choice and its runner-up by up to 0.22 (``scripts/tie_spread.py
#: --prompt 2 --first 4 --positions 1 --trials 200``; 0.16 over every reference's first three
#: tokens at 15 placements each); soaks' answers parted at gaps of 0.00-0.33, each once, the next
#: check's answers the fresh text again.
NEAR_TIE = 0.5
#: Tokens of each reference answer.
REFERENCE_TOKENS = 24
#: The node parameters the fresh engine is made of.
PARAMETERS = ("target.model_path", "target.n_ctx", "target.n_batch", "target.n_threads", "target.flash_attn",
              "chat.template_path", "generation.prompt_cache")


@dataclass
class Reference:
    """One reference request: its goal fields (Generate or GenerateChat), and the fresh engine's
    prompt tokens, tokens and text."""

    kind: str
    chat: bool
    fields: Dict[str, Any]
    prompt: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    text: str = ""


#: The references' priority: above the workload's (0-3), so that none is preempted.
REFERENCE_PRIORITY = 10


def references() -> List[Reference]:
    greedy = dict(max_tokens=REFERENCE_TOKENS, temperature=0.0, seed=1, spec_mode="off", priority=REFERENCE_PRIORITY)
    plain = [Reference(f"prompt {i}", False, dict(prompt=p, **greedy)) for i, p in enumerate(REFERENCE_PROMPTS)]
    chats = [Reference(f"chat {i}", True, dict(fields, **greedy)) for i, fields in enumerate(REFERENCE_CHATS)]
    return plain + chats


def request_of(reference: Reference, reuse: bool) -> GenerationRequest:
    """The engine's request for a reference's goal fields."""
    fields = reference.fields
    common = dict(max_tokens=fields["max_tokens"], sampling=SamplingParams(temperature=0.0, seed=fields["seed"]),
                  spec_mode=fields["spec_mode"], reuse_prompt=reuse)
    if not reference.chat:
        return GenerationRequest(prompt=fields["prompt"], **common)
    messages = tuple(ChatMessage(m["role"], m.get("content", ""), tool_call_id=m.get("tool_call_id", ""),
                                 tool_calls=tuple(ToolCall(c["id"], c["name"], c["arguments"])
                                                  for c in m.get("tool_calls", ())))
                     for m in fields["messages"])
    conversation = Conversation(messages, parse_tools(fields.get("tools", "")), fields.get("tool_choice") or "auto")
    return GenerationRequest(conversation=conversation, **common)


class FreshCheck:
    """The fresh engine's answers, and the comparison of the node's answers with them."""

    def __init__(self, parameters: Mapping[str, Any]) -> None:
        self.parameters = dict(parameters)
        self.references = references()
        self.reuse = bool(parameters["generation.prompt_cache"])
        config = EngineConfig(
            target=ModelConfig(os.path.expanduser(str(parameters["target.model_path"])),
                               n_ctx=int(parameters["target.n_ctx"]), n_batch=int(parameters["target.n_batch"]),
                               n_threads=int(parameters["target.n_threads"]),
                               flash_attn=bool(parameters["target.flash_attn"])),
            spec=SpecConfig(mode="off"), chat=ChatConfig(template_path=str(parameters["chat.template_path"] or "")))
        self.engine = Engine(config, calibrate=False)
        for reference in self.references:
            request = request_of(reference, self.reuse)
            reference.prompt = self.engine.prompt_tokens(request)
            steps = list(self.engine.generate(request))
            reference.tokens = [t for step in steps for t in step.tokens]
            reference.text = answer_text(reference.chat, "".join(step.text for step in steps),
                                         steps[-1].reply.content if steps[-1].reply is not None else "")

    def close(self) -> None:
        self.engine.close()

    def check(self, ask: Callable[[Reference], Tuple[bool, str]], when: str) -> Dict[str, Any]:
        """Ask the node each reference (``ask(reference) -> (answered, its text)``) and judge every
        answer; a dict for the report (when, and per reference: same | near-tie at k | differs)."""
        outcomes = []
        for reference in self.references:
            answered, text = ask(reference)
            outcomes.append((reference.kind, self.judge(reference, text) if answered else f"no answer: {text}"))
        return {"when": when, "outcomes": outcomes,
                "pass": all(o == "same" or o.startswith("near-tie") for _, o in outcomes)}

    def judge(self, reference: Reference, text: str) -> str:
        """``same``, ``near-tie at token k (gap g)``, or ``differs at token k (gap g): ...``."""
        if answer_text(reference.chat, text, text) == reference.text:
            return "same"
        want = b"".join(self.engine.target.token_bytes(t) for t in reference.tokens)
        got = text.encode("utf-8")
        if reference.chat:  # a reply's content is trimmed: compare from the fresh text's first non-space
            lead = len(want) - len(want.lstrip())
            got = want[:lead] + got
        done = b""
        for k, token in enumerate(reference.tokens):
            piece = self.engine.target.token_bytes(token)
            if got.startswith(done + piece):
                done += piece
                continue
            gap = self._gap(reference, k, got[len(done):])
            verdict = "near-tie" if gap <= NEAR_TIE else "differs"
            return (f"{verdict} at token {k} (gap {gap:.3f})" if verdict == "near-tie" else
                    f"differs at token {k} (gap {gap:.3f}): {text[:60]!r} != {reference.text[:60]!r}")
        if got == done:
            return "same"
        k, gap = self._went_on(reference, got)
        if gap <= NEAR_TIE:
            return f"near-tie at token {k} (gap {gap:.3f})"
        return f"differs at token {k} (gap {gap:.3f}), going on after the fresh text: {text[:60]!r}"

    def _went_on(self, reference: Reference, got: bytes) -> Tuple[int, float]:
        """(position, gap) where the node's text, which holds all of the fresh text and goes on,
        parted from it at the smallest gap: where the fresh engine ended its text (an end of
        generation before max_tokens), or where the node took a longer token whose text starts
        with the fresh token's (the texts agree up to there, the tokens do not)."""
        target = self.engine.target
        parts: List[Tuple[int, float]] = []
        done = 0
        for k, token in enumerate(reference.tokens):
            parts.append((k, self._gap(reference, k, got[done:], longer_than=token)))
            done += len(target.token_bytes(token))
        if len(reference.tokens) < reference.fields["max_tokens"]:
            parts.append((len(reference.tokens), self._gap(reference, len(reference.tokens), got[done:])))
        return min(parts, key=lambda part: part[1])

    def _gap(self, reference: Reference, k: int, rest: bytes, longer_than: Optional[int] = None) -> float:
        """How far below the fresh engine's best logit at position ``k`` the best token lies whose
        text ``rest`` (the node's text from there on) starts with; an end of generation where the
        node's text ended. With ``longer_than``, only tokens whose text is longer than that token's
        count. Infinite where no such token is among the top 64."""
        target = self.engine.target
        shortest = len(target.token_bytes(longer_than)) + 1 if longer_than is not None else 1
        context = list(reference.prompt) + list(reference.tokens[:k])
        target.clear()
        row = np.asarray(target.decode(context, [len(context) - 1])[-1], dtype=np.float64)
        target.clear()
        best = float(row.max())
        for candidate in np.argsort(row)[::-1][:64]:
            token = int(candidate)
            piece = target.token_bytes(token)
            if (len(piece) >= shortest and rest.startswith(piece)) or (
                    longer_than is None and not rest and target.is_eog(token)):
                return best - float(row[token])
        return float("inf")


def answer_text(chat: bool, streamed: str, content: str) -> str:
    """What is compared: a prompt's text, a chat turn's message content (trimmed)."""
    return content.strip() if chat else streamed


__all__ = ["FreshCheck", "NEAR_TIE", "PARAMETERS", "Reference", "references"]
