"""Conversation snapshots (engine/conversations.py) on a real tiny GGUF: a turn of another
conversation in between, the first one's follow-up still evaluates only its new tokens, with the
same logits; the store stays within its bytes, least recently used out first."""
from __future__ import annotations

import doctest
from typing import Iterator, List

import numpy as np
import pytest

from gemma_spec_ros.engine import conversations
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.conversations import ConversationCache
from gemma_spec_ros.engine.config import ModelConfig
from support.tiny_gguf import write_tiny_gguf


def test_module_doctests() -> None:
    assert doctest.testmod(conversations).failed == 0


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("conv") / "tiny.gguf", vocab_size=64, n_layer=2)
    model = LlamaModel(ModelConfig(str(path), n_ctx=1024, n_threads=1))
    yield model
    model.close()


def turn(backend: LlamaModel, prompt: List[int]) -> np.ndarray:
    """A turn's prompt pass with prompt reuse: keep the common prefix, decode the rest; the last
    row's logits."""
    reused = backend.reuse_prefix(prompt, keep_last=1)
    return backend.decode(prompt[reused:], [len(prompt) - reused - 1])[0].copy()


def conversation(seed: int, n: int) -> List[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 64, n)]


def test_a_follow_up_after_another_conversation_reuses_its_own_kv(backend: LlamaModel) -> None:
    cache = ConversationCache(max_bytes=64 << 20, min_gain=8)
    a1, b1 = conversation(1, 200), conversation(2, 180)
    a2 = a1 + conversation(3, 20)
    backend.clear()
    turn(backend, a1)
    cache.save(backend)
    turn(backend, b1)
    cache.save(backend)
    assert sorted(len(k) for k in cache.keys()) == [180, 200]
    restored = cache.restore_for(backend, a2)
    assert restored == 200 and backend.kv_tokens == a1
    assert backend.reuse_prefix(a2, keep_last=1) == 200  # only the 20 new tokens are decoded
    got = backend.decode(a2[200:], [19])[0].copy()
    backend.clear()
    assert np.array_equal(got, turn(backend, a2))  # the same logits as evaluating a2 whole


def test_the_store_keeps_within_its_bytes_and_drops_the_oldest(backend: LlamaModel) -> None:
    backend.clear()
    turn(backend, conversation(4, 100))
    one = ConversationCache(max_bytes=1 << 30)
    one.save(backend)
    size = one.bytes
    cache = ConversationCache(max_bytes=int(size * 2.5), min_gain=8)
    prompts = [conversation(10 + i, 100) for i in range(3)]
    for prompt in prompts:
        backend.clear()
        turn(backend, prompt)
        cache.save(backend)
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    assert [list(k) for k in cache.keys()] == prompts[1:]
    assert cache.restore_for(backend, prompts[0] + [5]) == 0  # evicted: evaluated afresh
    assert ConversationCache(max_bytes=size - 1).save(backend) is False


def test_a_later_turn_replaces_its_earlier_snapshot_and_small_gains_are_not_restored(backend: LlamaModel) -> None:
    cache = ConversationCache(max_bytes=64 << 20, min_gain=32)
    first = conversation(20, 100)
    backend.clear()
    turn(backend, first)
    cache.save(backend)
    later = first + conversation(21, 30)
    turn(backend, later)
    cache.save(backend)
    assert [len(k) for k in cache.keys()] == [130]
    backend.clear()
    turn(backend, later[:110])  # the cache holds 110 of the 130: a gain of 20 < 32
    assert cache.restore_for(backend, later + [7]) == 0 and cache.restored == 0
