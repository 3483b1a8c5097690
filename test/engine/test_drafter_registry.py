"""A drafter is a registered part: a kind registered from outside the package (test/support's toy
drafter) and a mode row added at run time are all it takes to generate with it; the built-in kinds
are what the mode table and the model files name."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from gemma_spec_ros.engine.config import SamplingParams, SpecConfig
from gemma_spec_ros.engine.drafters import registry
from gemma_spec_ros.engine.drafters.eagle3 import HEAD_ARCHITECTURE
from gemma_spec_ros.engine.drafters.mtp import ASSISTANT_ARCHITECTURE
from gemma_spec_ros.engine.modes import MODES, SPEC_MODES, Mode, add_mode, mode_problem, remove_mode
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine, collect
from support.tiny_gguf import write_tiny_pair
from support.toy_drafter import ReplayDrafter, build_replay


@pytest.fixture
def replay_mode() -> Iterator[str]:
    registry.register(registry.DrafterKind("replay", build_replay))
    add_mode(Mode("replay", ("replay",)))
    try:
        yield "replay"
    finally:
        remove_mode("replay")
        registry.unregister("replay")


def test_a_registered_drafter_and_mode_generate_losslessly(replay_mode: str, tmp_path) -> None:
    """The engine builds the toy kind with the built-in ones; its mode validates in the config and
    the request; a repeated greedy request (every drafter learns from every request, whatever its
    mode) is drafted in full and gives the same tokens as off."""
    assert "replay" in SPEC_MODES
    target, _ = write_tiny_pair(tmp_path)
    request = GenerationRequest(prompt="ab", max_tokens=24, sampling=SamplingParams(temperature=0.0),
                                use_chat_template=False, spec_mode="off")
    with build_engine(target, spec=SpecConfig(mode=replay_mode, adaptive=False, draft_max=4)) as engine:
        assert isinstance(engine.drafters["replay"].drafter, ReplayDrafter)
        assert set(engine.drafters) == {"replay", "lookup", "suffix"}
        plain = collect(engine, request).tokens
        first = collect(engine, replace(request, spec_mode=replay_mode))
        again = collect(engine, replace(request, spec_mode=replay_mode))
    assert first.tokens == again.tokens == plain and len(plain) == 24
    stats = again.steps[-1].stats
    drafted = stats.draft_tokens_by_source.get("replay", 0)
    # every token after the prompt's first was drafted and accepted, but the one each pass adds
    assert drafted == stats.accepted_tokens_by_source["replay"] == 24 - 1 - stats.num_drafts
    assert stats.num_drafts <= 24 // 4


def test_a_kind_or_mode_that_does_not_fit_the_table_is_refused(replay_mode: str) -> None:
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.DrafterKind("replay", build_replay))
    with pytest.raises(ValueError, match="no drafter kind 'warp'"):
        add_mode(Mode("warp", ("warp",)))
    with pytest.raises(ValueError, match="exists already"):
        add_mode(Mode("replay", ("replay",)))
    with pytest.raises(ValueError, match="no registered kind that runs draft.model_path"):
        add_mode(Mode("replay2", ("replay",), needs="replay"))
    with pytest.raises(ValueError, match="runs any draft model file already"):
        registry.register(registry.DrafterKind("other-draft", build_replay, model="another draft model"))
    assert "warp" not in MODES and "replay2" not in MODES
    assert mode_problem("replay", ["lookup"]) == ""  # it needs no model: it runs where it is loaded


def test_the_model_kinds_claim_their_files_architectures(tmp_path) -> None:
    """The registry's architectures are the ones the drafters check when they load; any other file is
    the draft model's (whose loader says what is wrong with it, if anything)."""
    assert registry.get("mtp").architectures == (ASSISTANT_ARCHITECTURE,)
    assert registry.get("eagle3").architectures == (HEAD_ARCHITECTURE,)
    target, _ = write_tiny_pair(tmp_path)
    assert registry.model_kind(str(target)).name == "draft"
    assert registry.model_kind(str(tmp_path / "missing.gguf")).name == "draft"
    assert [k.name for k in registry.kinds() if not k.several_at_once] == ["mtp", "eagle3"]
