"""The suffix drafter's history on a served node (real rclpy node, a tiny real GGUF): spec.mode
``suffix`` answers a goal, the history of its output is saved at cleanup into the folder the node
owns (``suffix.history_path`` a file name in ``lookup.cache_dir``, as the shipped profiles give it)
and loaded by the next configure; a file the node did not write is refused before any model loads
and left untouched, a damaged one of its own is moved aside with a warning.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterator

import pytest

from gemma_spec_ros.engine.drafters import suffix_history
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.config import ModelConfig
from support.node import ServedNode, greedy_answer, node_factory
from support.tiny_gguf import write_tiny_gguf

HISTORY = "suffix-history.bin"
PROMPT = "ab ab ab ab"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("suffix_history") / "tiny.gguf", vocab_size=64, seed=3)


@pytest.fixture(scope="module")
def vocab_tag(tiny_model: Path) -> str:
    model = LlamaModel(ModelConfig(str(tiny_model), n_ctx=64, n_threads=1))
    try:
        return model.vocab_tag()
    finally:
        model.close()


@pytest.fixture
def serve(ros: None, tiny_model: Path, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[Callable[..., ServedNode]]:
    """``serve(**overrides)``: an unconfigured node of this test alone in spec.mode suffix, its
    learned files in ``tmp_path`` (``a__b`` names the parameter ``a.b``; one node name per test)."""
    name = "suffix_history_" + request.node.name.replace("test_", "", 1)[:40]
    with node_factory() as make_node:
        made = [0]

        def make(**overrides: Any) -> ServedNode:
            values: Dict[str, Any] = {"target.model_path": str(tiny_model), "target.n_ctx": 256,
                                      "target.n_threads": 1, "spec.mode": "suffix", "spec.adaptive": False,
                                      "spec.draft_max": 3, "generation.max_tokens": 12,
                                      "limits.max_prompt_tokens": 128, "diagnostics.period": 0.1,
                                      "lookup.cache_dir": str(tmp_path),
                                      "lookup.dynamic_path": str(tmp_path / "lookup-learned.bin"),
                                      "suffix.history_path": HISTORY}
            values.update({key.replace("__", "."): value for key, value in overrides.items()})
            made[0] += 1
            return make_node(f"{name}_{made[0]}", values, activate=False)
        yield make


def history_of(served: ServedNode) -> list:
    """The sequences the running engine's suffix drafter holds (the engine's own object: what was
    loaded shows nowhere else)."""
    return served.node._engine.drafters["suffix"].drafter.index.sequences()


@pytest.mark.timeout(300)
def test_a_suffix_node_saves_its_history_at_cleanup_and_loads_it_at_the_next_configure(
        serve: Any, tmp_path: Path, vocab_tag: str) -> None:
    served = serve()
    client = served.client
    assert client.transition("configure"), served.node.configure_error
    assert client.transition("activate")
    result = greedy_answer(client, PROMPT, 12)
    assert result.finish_reason in ("stop", "length") and result.spec_mode == "suffix"
    assert result.completion_tokens > 0
    mark = client.log_mark()
    assert client.transition("deactivate") and client.transition("cleanup")
    client.wait_log(f"suffix history saved to {tmp_path / HISTORY}", since=mark)
    [saved] = suffix_history.load(tmp_path / HISTORY, vocab_tag)
    assert len(saved) == result.completion_tokens  # the output (the prompt is not kept)

    assert client.transition("configure"), served.node.configure_error
    assert history_of(served) == [saved]
    assert client.transition("activate")
    again = greedy_answer(client, PROMPT, 12)
    assert again.text == result.text and again.stats.num_drafts > 0  # drafted from the loaded history
    assert client.transition("deactivate") and client.transition("cleanup")
    assert suffix_history.load(tmp_path / HISTORY, vocab_tag)[-2:] == [saved, saved]


@pytest.mark.timeout(120)
def test_a_foreign_history_file_fails_configure_before_loading_and_is_left_untouched(
        serve: Any, tmp_path: Path) -> None:
    victim = tmp_path / HISTORY
    victim.write_bytes(b"ssh-ed25519 AAAA... robot@base\n")
    served = serve()
    assert served.client.transition("configure") is False
    assert "not a suffix history" in served.node.configure_error
    assert victim.read_bytes() == b"ssh-ed25519 AAAA... robot@base\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [HISTORY]


@pytest.mark.timeout(120)
def test_a_damaged_history_is_moved_aside_with_a_warning(serve: Any, tmp_path: Path, vocab_tag: str) -> None:
    path = tmp_path / HISTORY
    suffix_history.save([[5, 6, 7, 8]], path, vocab_tag)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    served = serve()
    client = served.client
    mark = client.log_mark()
    assert client.transition("configure"), served.node.configure_error
    client.wait_log("checksum mismatch", since=mark)
    assert history_of(served) == []
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data)


@pytest.mark.timeout(120)
def test_a_history_of_another_vocabulary_is_refused(serve: Any, tmp_path: Path) -> None:
    path = tmp_path / HISTORY
    suffix_history.save([[5, 6, 7, 8]], path, "vocab-1-49152-" + "cd" * 20)
    before = path.read_bytes()
    served = serve()
    assert served.client.transition("configure") is False
    assert "another vocabulary" in served.node.configure_error
    assert path.read_bytes() == before
