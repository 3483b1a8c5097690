"""The tiny GGUF models load in llama.cpp and behave like small language models."""
from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from support.maths import softmax
from support.tiny_gguf import (BOS_ID, EOS_ID, logits_of, tiny_vocab, tokenize, write_tiny_gguf,
                               write_tiny_pair)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_model_loads_with_a_spread_distribution(tmp_path: Path, arch: str) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", arch=arch)
    tokens = tokenize(path, "the cat sat.")
    logits = logits_of(path, tokens)
    assert logits.shape == (len(tokens), 32)
    assert np.isfinite(logits).all()
    probs = softmax(logits)
    assert probs.max() < 0.9, "one-hot: the next token is nearly certain"
    assert ((probs > 0.02).sum(axis=1) >= 3).all(), "fewer than 3 tokens with noticeable mass"
    assert not np.allclose(logits[0], logits[-1]), "the distribution ignores the context"


def test_vocabulary_and_special_tokens(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", vocab_size=40)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        assert llama_cpp.llama_vocab_n_tokens(vocab) == 40
        assert (llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)) == (BOS_ID,
                                                                                         EOS_ID)
        assert llama_cpp.llama_vocab_is_eog(vocab, EOS_ID)
        piece = (llama_cpp.ctypes.c_char * 16)()
        pieces = []
        for token in range(3, 40):
            n = llama_cpp.llama_token_to_piece(vocab, token, piece, len(piece), 0, False)
            pieces.append(bytes(piece[:n]).decode())
    finally:
        llama_cpp.llama_model_free(model)
    assert "".join(pieces) == " abcdefghijklmnopqrstuvwxyz.\n01234567"
    # one token per known character; the BOS first; unknown characters are dropped, not fatal
    vocabulary = tiny_vocab(40)
    assert tokenize(path, "ab c.\n") == [BOS_ID] + [vocabulary.index(t) for t in "abĠc.Ċ"]
    assert tokenize(path, "a\u00e9b", add_bos=False) == [vocabulary.index("a"),
                                                         vocabulary.index("b")]


def test_pair_shares_the_vocabulary_but_not_the_weights(tmp_path: Path) -> None:
    target, draft = write_tiny_pair(tmp_path)
    text = "a cat. a dog."
    assert tokenize(target, text) == tokenize(draft, text)
    tokens = tokenize(target, text)
    p, q = softmax(logits_of(target, tokens)), softmax(logits_of(draft, tokens))
    assert p.shape == q.shape
    overlap = np.minimum(p, q).sum(axis=1)  # the acceptance probability of rejection sampling
    assert ((overlap > 0.05) & (overlap < 0.95)).all(), overlap


def test_files_are_reproducible_and_batches_agree(tmp_path: Path) -> None:
    first = write_tiny_gguf(tmp_path / "a.gguf", seed=7)
    second = write_tiny_gguf(tmp_path / "b.gguf", seed=7)
    assert first.read_bytes() == second.read_bytes()
    tokens = tokenize(first, "hello world.")
    batched = logits_of(first, tokens)
    # F32 weights: the last row of a whole-prompt batch equals the logits of the same prefix
    # decoded as a shorter batch (what exact speculative verification relies on).
    shorter = logits_of(first, tokens[:-1])
    np.testing.assert_allclose(batched[:-1], shorter, rtol=1e-4, atol=1e-4)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        write_tiny_gguf(tmp_path / "m.gguf", arch="gpt9")
    with pytest.raises(ValueError, match="n_embd"):
        write_tiny_gguf(tmp_path / "m.gguf", n_embd=12)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_vocab(2)
