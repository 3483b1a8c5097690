"""Special-token texts found in one scan (engine/llama/special_texts.py) split a text exactly as
llama.cpp's special-token parsing does, on the embedded Gemma 3 vocabulary (6,250 control and 165
user-defined tokens) and on a tiny chat vocabulary: seeded random texts made of turn markers, runs
of the user-defined whitespace tokens, pieces of markers, ``<`` runs and plain text; and the inputs
that took seconds in llama.cpp's own parsing take milliseconds."""
from __future__ import annotations

import doctest
import random
from pathlib import Path
from typing import Iterator, List

import pytest

from gemma_spec_ros.engine.config import ModelConfig
from gemma_spec_ros.engine.llama import special_texts
from gemma_spec_ros.engine.llama.chat_prompt import split_at_control_tokens
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.llama.special_texts import SpecialTexts
from support.tiny_chat_gguf import CONTROL_TOKENS, write_tiny_chat_gguf


def test_module_doctests() -> None:
    assert doctest.testmod(special_texts).failed == 0


@pytest.fixture(scope="module")
def gemma(embedded_model_path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(ModelConfig(str(embedded_model_path), n_ctx=64, n_threads=1))
    yield model
    model.close()


def random_text(rng: random.Random, markers: List[str]) -> str:
    pieces = []
    for _ in range(rng.randint(1, 30)):
        kind = rng.random()
        marker = rng.choice(markers)
        if kind < 0.3:
            pieces.append(marker)
        elif kind < 0.45:  # a piece of a marker, or a marker with a piece of another glued on
            cut = rng.randint(1, len(marker))
            pieces.append(marker[:cut] if rng.random() < 0.5 else marker[cut:] + rng.choice(markers))
        elif kind < 0.6:
            pieces.append(rng.choice([" ", "\n", "\t"]) * rng.randint(1, 40))
        elif kind < 0.7:
            pieces.append("<" * rng.randint(1, 9))
        else:
            pieces.append("".join(rng.choice("ab <>_/|x\n") for _ in range(rng.randint(1, 12))))
    return "".join(pieces)


def test_the_split_is_llama_cpps_on_gemmas_vocabulary(gemma: LlamaModel) -> None:
    special = SpecialTexts.of(gemma)
    assert special is not None and len(special.parsed) >= 6000
    markers = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unused7>", "<unused70>",
               "<start_of_image>", "[multimodal]", "<mask>", "<unk>"]
    rng = random.Random(5)
    for _ in range(400):
        text = random_text(rng, markers)
        assert special.split(text) == split_at_control_tokens(gemma, text), repr(text)


def test_the_split_is_llama_cpps_on_a_tiny_chat_vocabulary(tmp_path: Path) -> None:
    model = LlamaModel(ModelConfig(str(write_tiny_chat_gguf(tmp_path / "chat.gguf")), n_ctx=64, n_threads=1))
    try:
        special = SpecialTexts.of(model)
        assert special is not None and set(CONTROL_TOKENS) <= set(special.parsed)
        rng = random.Random(6)
        for _ in range(300):
            text = random_text(rng, list(CONTROL_TOKENS))
            assert special.split(text) == split_at_control_tokens(model, text), repr(text)
    finally:
        model.close()


def test_the_texts_that_took_seconds_in_llama_cpps_parsing_split_whole(gemma: LlamaModel) -> None:
    """60,000 ``<`` (a tool schema's enum value: 5.5-12 s through llama.cpp's parsing), 20,000 turn
    markers (quadratic there) and whitespace runs: every character kept, every marker found
    (scripts/goal_check_costs.py times them: milliseconds)."""
    special = SpecialTexts.of(gemma)
    assert special is not None
    turn = "<start_of_turn>user\n<end_of_turn>\n"
    for text, markers in (("<" * 60000, 0), (turn * 10000, 20000), (" \n" * 30000, 0)):
        parts = special.split(text)
        assert sum(isinstance(p, int) for p in parts) == markers
        assert "".join(p if isinstance(p, str) else gemma.token_text(p).decode() for p in parts) == text
