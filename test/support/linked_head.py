"""Checks shared by the two drafters that read the target's own rows (MTP's assistant and an
EAGLE-3 head): each test module runs them on its own tiny agreeing pair and engine."""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import List, Optional, Tuple

from gemma_spec_ros.engine.config import SamplingParams
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.request import GenerationRequest, Step


def run(engine: Engine, mode: str, prompt: str, max_tokens: int, sampling: SamplingParams = SamplingParams(),
        cancel: Optional[threading.Event] = None, grammar: str = "") -> Tuple[List[int], List[Step]]:
    """One request in ``mode``: its tokens and its steps."""
    request = GenerationRequest(prompt, max_tokens=max_tokens, spec_mode=mode, sampling=sampling, grammar=grammar)
    steps = list(engine.generate(request, cancel))
    return [t for s in steps for t in s.tokens], steps


def check_k_and_mode_switched_while_generating(engine: Engine, prompt: str, max_tokens: int, k: int) -> None:
    """K k -> 1, then the engine's mode -> off -> back, applied at step boundaries; no reload; the
    same text as ``off``. Back in the mode the drafter starts over: the first pass exports the rows
    it reads, the next drafts. ``engine`` is in the drafter's mode with a fixed K of ``k``, and its
    drafts are all accepted (an agreeing pair)."""
    mode = engine.spec.mode
    reference, _ = run(engine, "off", prompt, max_tokens)
    request = GenerationRequest(prompt, max_tokens=max_tokens)  # the engine's mode
    spec = engine.spec
    steps: List[Step] = []
    for step in engine.generate(request):
        steps.append(step)
        if len(steps) == 10:
            engine.update_spec(replace(spec, draft_max=1))
        elif len(steps) == 20:
            engine.update_spec(replace(spec, mode="off"))
        elif len(steps) == 30:
            engine.update_spec(spec)
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == reference
    gains = [len(s.tokens) for s in steps]
    assert max(gains[1:10]) == k + 1  # k accepted + the bonus token
    assert max(gains[10:20]) == 2 and [s.draft_max for s in steps[10:20]] == [1] * 10
    assert set(gains[20:30]) == {1} and {s.spec_mode for s in steps[20:30]} == {"off"}
    assert gains[30] == 1 and max(gains[31:]) == k + 1  # nothing exported yet at the first step back
    assert steps[-1].stats.drafts_by_source == {mode: steps[-1].stats.num_drafts}


#: Most of its text forced, a choice in each sentence (the tiny pairs' vocabulary is one token per
#: character, so every forced character is a row whose token the grammar allows alone).
CHOICES_GRAMMAR = 'root ::= ("the robot picks up the " ("red" | "blue" | "green") " cup. ")+'


def check_under_a_grammar(engine: Engine, prompt: str, max_tokens: int) -> None:
    """Under a grammar the drafter's mode emits what constrained ``off`` emits, with the verify rows
    whose token the grammar allows alone decoded without logits: the rows the drafter reads from
    the target (the last kept row's hidden state, or every row's features) are still there."""
    mode = engine.spec.mode
    reference, _ = run(engine, "off", prompt, max_tokens, grammar=CHOICES_GRAMMAR)
    tokens, steps = run(engine, mode, prompt, max_tokens, grammar=CHOICES_GRAMMAR)
    assert tokens == reference and len(tokens) == max_tokens
    assert steps[-1].stats.num_grammar_sole_rows > 0
