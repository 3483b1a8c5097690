"""Files that hold token ids the target's vocabulary lacks (review Q7), through the real Engine on a
tiny model of 40 tokens: a suffix history with a valid header and checksum is moved aside as damaged
and the engine keeps serving; a static n-gram cache of another model is refused at startup.

Before the fix the history loaded ("engine loaded the file") and every request whose context
matched it failed: the drafter drafted id 40, llama.cpp logged ``init: invalid token[..] = 40`` and
refused the whole batch (``KVCacheError: llama_decode failed with code -1``).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from gemma_spec_ros.engine.config import EngineConfig, LookupConfig, ModelConfig, SpecConfig, SuffixConfig
from gemma_spec_ros.engine.drafters import learned_cache, suffix_history
from gemma_spec_ros.engine.drafters.ngram_cache import NgramCache
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import CacheFormatError
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import collect
from support.tiny_gguf import write_tiny_gguf

N_VOCAB = 40
PROMPT = "the arm picks the cup. the arm picks the cup."


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("vocab") / "v40.gguf", vocab_size=N_VOCAB, seed=7)


def vocab_tag(model: Path) -> str:
    target = LlamaModel(ModelConfig(str(model), n_ctx=64, n_threads=1))
    try:
        assert target.n_vocab == N_VOCAB
        return target.vocab_tag()
    finally:
        target.close()


def engine_config(model: Path, **fields: object) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model), n_ctx=256, n_threads=1),
                        spec=SpecConfig(mode="suffix", draft_max=4, adaptive=False), **fields)


@pytest.mark.timeout(300)
def test_a_history_with_ids_outside_the_vocabulary_is_moved_aside_and_the_engine_serves(
        tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "suffix-history.bin"
    # every token is followed by 40 (one past the last id) and 2**31 - 1: any context matches
    suffix_history.save([[t, N_VOCAB, 2**31 - 1] for t in range(N_VOCAB)], path, vocab_tag(tiny_model))
    data = path.read_bytes()
    suffix = SuffixConfig(history_path=str(path), cache_dir=str(tmp_path))
    with Engine(engine_config(tiny_model, suffix=suffix), calibrate=False) as engine:
        for _ in range(2):  # the second request drafts from the first one's answer
            done = collect(engine, GenerationRequest(PROMPT, max_tokens=12, spec_mode="suffix"))
            assert done.steps[-1].finish_reason == "length" and len(done.tokens) == 12
            assert all(0 <= t < N_VOCAB for t in done.tokens)
        warnings = [w for w in engine.warnings if "suffix history" in w]
        assert len(warnings) == 1 and "outside the vocabulary of 40 tokens" in warnings[0], engine.warnings
        assert "moved it to" in warnings[0]
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == data
    assert suffix_history.load(path, vocab_tag(tiny_model))  # the new history, saved at close


@pytest.mark.timeout(300)
def test_a_static_cache_of_another_vocabulary_fails_the_engine(tiny_model: Path, tmp_path: Path) -> None:
    """llama.cpp's plain static cache names no vocabulary: one built for another model loaded and
    its drafts (every 2-gram -> 40 here) failed the lookup requests."""
    static_path = tmp_path / "other-model.lcd"
    static = NgramCache()
    for a in range(N_VOCAB):
        static.update([a, 3, N_VOCAB, a, 3, N_VOCAB], 2, 2)
    static.save(static_path)
    config = engine_config(tiny_model, lookup=LookupConfig(static_path=str(static_path)))
    with pytest.raises(CacheFormatError, match="outside this model's vocabulary of 40 tokens"):
        Engine(config, calibrate=False)
    assert static_path.read_bytes() == static.to_bytes()  # a static cache is never moved


@pytest.mark.timeout(300)
def test_a_learned_cache_with_ids_outside_the_vocabulary_is_moved_aside(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "dynamic.bin"
    learned = NgramCache()
    learned.update([5, 6, N_VOCAB, 5, 6, N_VOCAB], 1, 4)
    learned_cache.save(learned, path, vocab_tag(tiny_model))
    lookup = LookupConfig(dynamic_path=str(path), cache_dir=str(tmp_path))
    with Engine(engine_config(tiny_model, lookup=lookup), calibrate=False) as engine:
        assert any("outside this model's vocabulary of 40 tokens" in w and "moved it to" in w
                   for w in engine.warnings), engine.warnings
        assert engine.dynamic_ngrams() == 0
        done = collect(engine, GenerationRequest(PROMPT, max_tokens=8, spec_mode="lookup"))
        assert done.steps[-1].finish_reason == "length"
    assert [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
