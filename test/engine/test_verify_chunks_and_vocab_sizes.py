"""Speculation where verification is unusual: a target.n_batch smaller than the verify batch (the
pass runs in chunks, every row still its own position's logits, greedy output still plain output),
a draft whose vocabulary is larger or smaller than the target's (both verifications). Real llama.cpp
on tiny GGUFs. Regressions at the engine level: each test names the defect it guards and fails on
the code before its fix."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine
from support.tiny_gguf import write_tiny_gguf


REPEAT_PROMPT = "abcab abcab abcab abcab abcab abcab abcab"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_reliability")


def test_chunked_verify_keeps_every_row(tiny_dir: Path) -> None:
    """Defect 4: with target.n_batch smaller than the batch, every requested row is the logits of its
    own position (before: rows of earlier chunks were views the next chunk overwrote)."""
    path = write_tiny_gguf(tiny_dir / "t.gguf", vocab_size=40, seed=5)
    tokens = [1, 4, 5, 6, 7, 8, 9]
    whole = LlamaModel(ModelConfig(str(path), n_ctx=64, n_batch=64, n_threads=1))
    chunked = LlamaModel(ModelConfig(str(path), n_ctx=64, n_batch=2, n_threads=1))
    try:
        want = [row.copy() for row in whole.decode(tokens, range(len(tokens)))]
        got = chunked.decode(tokens, range(len(tokens)))
        assert len(got) == len(tokens)
        for i, (a, b) in enumerate(zip(want, got)):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=f"row {i}")
    finally:
        whole.close()
        chunked.close()


def test_small_n_batch_speculation_is_lossless(tiny_dir: Path) -> None:
    """Defect 4, end to end: n_batch 2 < K + 1 with lookup drafts: greedy output equals plain output."""
    path = write_tiny_gguf(tiny_dir / "t.gguf", vocab_size=40, seed=5)
    request = GenerationRequest(REPEAT_PROMPT, max_tokens=40, reuse_prompt=False)
    texts = {}
    for mode in ("off", "lookup"):
        engine = build_engine(path, n_threads=1, n_batch=2, spec=SpecConfig(mode=mode, draft_max=6, adaptive=False))
        try:
            steps = list(engine.generate(request))
            texts[mode] = "".join(s.text for s in steps)
        finally:
            engine.close()
    assert texts["lookup"] == texts["off"]


@pytest.mark.parametrize("target_vocab,draft_vocab", [(40, 48), (48, 40)])
@pytest.mark.parametrize("verification", ["exact", "rejection"])
def test_draft_and_target_vocabularies_of_different_sizes(tiny_dir: Path, target_vocab: int,
                                                          draft_vocab: int, verification: str) -> None:
    """Defect 6: a draft whose vocabulary is larger or smaller than the target's (llama.cpp allows
    128 tokens) drafts only shared ids, and both verifications work (before: rejection subtracted
    arrays of different lengths, a larger draft proposed ids the target lacks)."""
    target = write_tiny_gguf(tiny_dir / f"vt{target_vocab}.gguf", vocab_size=target_vocab, seed=0)
    draft = write_tiny_gguf(tiny_dir / f"vd{draft_vocab}.gguf", vocab_size=draft_vocab, n_embd=16,
                            seed=1)
    engine = build_engine(target, draft, n_threads=1,
                          spec=SpecConfig(mode="draft", draft_max=4, p_min=0.0, adaptive=False,
                                          verification=verification))
    try:
        for seed in range(6):
            request = GenerationRequest("ab ba", max_tokens=24, reuse_prompt=False,
                                        sampling=SamplingParams(temperature=1.0, seed=seed))
            steps = list(engine.generate(request))
            assert steps[-1].finish_reason in ("stop", "length")
            tokens = [t for s in steps for t in s.tokens]
            assert all(0 <= t < target_vocab for t in tokens)
        assert engine.rolling_stats().num_draft_tokens > 0
    finally:
        engine.close()
