"""A robot's first configure: only the model files exist (real rclpy node, tiny real GGUFs).

The shipped profiles keep the learned n-gram cache at ``~/.cache/gemma_spec_ros/...``, which a fresh
home does not have: the node creates that folder itself (mode 0700), inside ``lookup.cache_dir`` and
nowhere else. Every model and cache path is checked before the first model loads, so a missing draft
or an unusable cache path fails configure at once (on an Orin a 4 GB target takes tens of seconds to
load). "Before loading" shows in the log: configure logs "configuring: loading" just before the load.
"""
from __future__ import annotations

import stat
from pathlib import Path
from typing import Any, Callable, Dict, Iterator

import pytest

from gemma_spec_ros.engine.drafters import learned_cache
from support.node import ServedNode, node_factory
from support.tiny_gguf import write_tiny_gguf

LOADING = "configuring: loading"


def loaded(served: ServedNode) -> bool:
    """Whether this node has logged that it is loading models."""
    return any(LOADING in m.msg for m in served.client.logs if m.name == served.name)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("first_launch") / "tiny.gguf", vocab_size=64, seed=3)


@pytest.fixture
def serve(ros: None, tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., ServedNode]]:
    """``serve(**overrides)``: an unconfigured node of this test alone on the tiny model (``a__b``
    names the parameter ``a.b``), named after the test (/rosout replays a node's earlier logs to
    a new subscriber: one name per test keeps them apart)."""
    name = "first_launch_" + request.node.name.replace("test_", "", 1)[:40]
    with node_factory() as make_node:
        def make(**overrides: Any) -> ServedNode:
            values: Dict[str, Any] = {"target.model_path": str(tiny_model), "target.n_ctx": 256,
                                      "target.n_threads": 1, "spec.mode": "lookup",
                                      "generation.max_tokens": 8, "limits.max_prompt_tokens": 128,
                                      "diagnostics.period": 0.1}
            values.update({name.replace("__", "."): value for name, value in overrides.items()})
            return make_node(name, values, activate=False)
        yield make


def test_configure_creates_the_learned_cache_folder_in_a_fresh_home(serve: Any, tmp_path: Path) -> None:
    """Before: configure failed ("the folder of the dynamic n-gram cache ... does not exist"), after
    loading the models, unless a setup step had made the folder."""
    home = tmp_path / "home"
    home.mkdir()
    cache_dir = home / ".cache" / "gemma_spec_ros"
    served = serve(lookup__cache_dir=str(cache_dir), lookup__dynamic_path=str(cache_dir / "lookup-learned.bin"))
    client = served.client
    mark = client.log_mark()
    assert client.transition("configure"), served.node.configure_error
    for folder in (home / ".cache", cache_dir):
        assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    client.wait_log(f"created {cache_dir} (mode 0700)", since=mark)
    assert client.transition("activate")
    run = client.send(prompt="ab ab ab ab", max_tokens=6, temperature=0.0)
    assert run.accepted and run.wait_result().finish_reason in ("stop", "length")
    assert client.transition("deactivate") and client.transition("cleanup")
    _, cache = learned_cache.read(cache_dir / "lookup-learned.bin")
    assert len(cache) > 0, "the learned cache was not saved into the folder the node made"


def test_no_folder_is_created_outside_the_cache_dir(serve: Any, tmp_path: Path) -> None:
    """Without a lookup.cache_dir the node owns no folder: a missing one fails configure with what
    to do, before any model loads, and nothing is created."""
    missing = tmp_path / "no" / "such"
    served = serve(lookup__cache_dir="", lookup__dynamic_path=str(missing / "learned.bin"))
    client = served.client
    mark = client.log_mark()
    assert client.transition("configure") is False
    assert "does not exist: create it" in served.node.configure_error
    assert not (tmp_path / "no").exists()
    client.wait_log("configure failed", since=mark)
    assert not loaded(served), "a model loaded before the check"


def test_a_missing_draft_fails_configure_before_the_target_loads(serve: Any, tmp_path: Path) -> None:
    """Before: the target loaded (tens of seconds for a 4 GB file on an Orin), then the draft failed."""
    draft = tmp_path / "gemma-3-1b-it-q4_0.gguf"
    served = serve(draft__model_path=str(draft), spec__mode="draft",
                   lookup__cache_dir=str(tmp_path), lookup__dynamic_path=str(tmp_path / "learned.bin"))
    client = served.client
    mark = client.log_mark()
    assert client.transition("configure") is False
    assert f"model file not found: {draft}" in served.node.configure_error
    client.wait_log(f"model file not found: {draft}", since=mark)
    assert not loaded(served), "the target loaded before the check"


def test_a_foreign_file_at_the_cache_path_fails_configure_before_loading(serve: Any, tmp_path: Path) -> None:
    """A file this node did not write is refused and left untouched, and now before any model loads."""
    victim = tmp_path / "authorized_keys"
    victim.write_bytes(b"ssh-ed25519 AAAA... robot@base\n")
    served = serve(lookup__cache_dir=str(tmp_path), lookup__dynamic_path=str(victim))
    client = served.client
    mark = client.log_mark()
    assert client.transition("configure") is False
    assert "not a learned n-gram cache" in served.node.configure_error
    client.wait_log("configure failed", since=mark)
    assert not loaded(served), "a model loaded before the check"
    assert victim.read_bytes() == b"ssh-ed25519 AAAA... robot@base\n"
