"""Tiny random-weight GGUF models for fast engine tests (llama.cpp loads them in milliseconds).

    target, draft = write_tiny_pair(tmp_path)        # same vocabulary, different weights
    path = write_tiny_gguf(tmp_path / "m.gguf", vocab_size=48, seed=3, arch="gemma3")

The vocabulary is GPT-2 style byte-level BPE ("gpt2" tokenizer, "default" pre-tokenizer):
``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS), then ``Ġ`` (space), ``a``..``z``, ``.``, ``Ċ`` (newline),
then more printable ASCII, then ``<tok{i}>`` fillers. Text made of those characters tokenizes to one
token per character; characters outside the vocabulary are dropped by llama.cpp's BPE tokenizer
(it never fails). Only the token ids matter to the models.

Weights are F32 and random (``numpy.random.default_rng(seed)``), scaled so that the next-token
distribution is spread over several tokens (logit standard deviation about ``LOGIT_SCALE``) and
depends on the context. Two calls with the same arguments write byte-identical files.

:func:`logits_of` and :func:`tokenize` read a model back with llama-cpp-python's low-level API, for
tests that need the exact next-token distribution of a model.
"""
from __future__ import annotations

import contextlib
import math
import os
import string
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple, Union

import gguf
import numpy as np

PathLike = Union[str, "os.PathLike[str]"]

SPECIAL_TOKENS: Tuple[str, ...] = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
#: Byte-level BPE spells a space "Ġ" (U+0120) and a newline "Ċ" (U+010A); printable ASCII is itself.
SPACE, NEWLINE = "\u0120", "\u010a"
#: Standard deviation of the logits: ~1 gives several tokens with noticeable probability.
LOGIT_SCALE = 1.0
ARCHITECTURES: Tuple[str, ...] = ("llama", "gemma3")
HEAD_DIM = 8


def tiny_vocab(vocab_size: int) -> List[str]:
    """The token texts (byte-level spelling) of a ``vocab_size`` vocabulary; the same for any model.

    >>> tiny_vocab(32)[:6]
    ['<unk>', '<s>', '</s>', 'Ġ', 'a', 'b']
    """
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size}: need at least {len(SPECIAL_TOKENS) + 1}")
    singles = [SPACE, *string.ascii_lowercase, ".", NEWLINE]
    singles += [c for c in string.printable[:94] if c not in singles]  # digits, A-Z, punctuation
    tokens = list(SPECIAL_TOKENS) + singles
    tokens += [f"<tok{i}>" for i in range(len(tokens), vocab_size)]
    return tokens[:vocab_size]


def _add_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    tokens = tiny_vocab(vocab_size)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.NORMAL] * (vocab_size - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # llama.cpp requires a merges array. A merge whose result is not a token falls back to its
    # bytes, so this one is harmless: "ab" still tokenizes to [a, b].
    writer.add_token_merges(["a b"])
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def _tensor_name(kind: gguf.MODEL_TENSOR, layer: int = -1) -> str:
    name = gguf.TENSOR_NAMES[kind]
    return (name.format(bid=layer) if layer >= 0 else name) + ".weight"


def _random_weights(vocab_size: int, n_embd: int, n_ff: int, n_layer: int, arch: str,
                    rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """Tensors in numpy order (rows = ggml's ne[1]): a (out, in) matrix is ggml's [in, out]."""
    T = gguf.MODEL_TENSOR

    def matrix(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tensors = {
        _tensor_name(T.TOKEN_EMBD): matrix(vocab_size, n_embd, 1.0),
        _tensor_name(T.OUTPUT_NORM): ones(n_embd),
        # The final RMS norm makes the hidden state's norm ~sqrt(n_embd): this std gives
        # logits with standard deviation ~LOGIT_SCALE.
        _tensor_name(T.OUTPUT): matrix(vocab_size, n_embd, LOGIT_SCALE / math.sqrt(n_embd)),
    }
    proj = 1.0 / math.sqrt(n_embd)
    for layer in range(n_layer):
        tensors.update({
            _tensor_name(T.ATTN_NORM, layer): ones(n_embd),
            _tensor_name(T.ATTN_Q, layer): matrix(n_embd, n_embd, proj),
            _tensor_name(T.ATTN_K, layer): matrix(n_embd, n_embd, proj),
            _tensor_name(T.ATTN_V, layer): matrix(n_embd, n_embd, proj),
            _tensor_name(T.ATTN_OUT, layer): matrix(n_embd, n_embd, proj),
            _tensor_name(T.FFN_NORM, layer): ones(n_embd),
            _tensor_name(T.FFN_GATE, layer): matrix(n_ff, n_embd, proj),
            _tensor_name(T.FFN_UP, layer): matrix(n_ff, n_embd, proj),
            _tensor_name(T.FFN_DOWN, layer): matrix(n_embd, n_ff, 1.0 / math.sqrt(n_ff)),
        })
        if arch == "gemma3":  # stored norm weights are the effective ones (the converter adds 1)
            tensors.update({
                _tensor_name(T.ATTN_Q_NORM, layer): ones(HEAD_DIM),
                _tensor_name(T.ATTN_K_NORM, layer): ones(HEAD_DIM),
                _tensor_name(T.ATTN_POST_NORM, layer): ones(n_embd),
                _tensor_name(T.FFN_POST_NORM, layer): ones(n_embd),
            })
    return tensors


def write_tiny_gguf(path: PathLike, vocab_size: int = 32, n_embd: int = 32, n_layer: int = 1,
                    seed: int = 0, arch: str = "llama", n_ctx_train: int = 4096,
                    sliding_window: int = 0) -> Path:
    """Write a random-weight F32 model with the :func:`tiny_vocab` vocabulary; returns ``path``.

    ``arch`` is ``llama`` or ``gemma3``. A gemma3 model's sliding-window layers (5 of every 6, as
    llama.cpp builds Gemma 3) see the last ``sliding_window`` positions (0: ``n_ctx_train``, so
    attention is full); a small window makes llama.cpp's window-sized cache wrap after a few
    hundred tokens.
    ``n_embd`` must be a multiple of 8 (heads of 8 dimensions). The file is written under a
    temporary name and renamed, so a reader never sees a partial file.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r}: expected one of {', '.join(ARCHITECTURES)}")
    if n_embd < HEAD_DIM or n_embd % HEAD_DIM:
        raise ValueError(f"n_embd={n_embd}: must be a positive multiple of {HEAD_DIM}")
    if n_layer < 1:
        raise ValueError(f"n_layer={n_layer}: must be >= 1")
    path = Path(path)
    n_head, n_ff = n_embd // HEAD_DIM, 2 * n_embd
    rng = np.random.default_rng(seed)
    tensors = _random_weights(vocab_size, n_embd, n_ff, n_layer, arch, rng)

    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    writer.add_name(f"tiny-{arch}-v{vocab_size}-e{n_embd}-l{n_layer}-s{seed}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(vocab_size)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(sliding_window or n_ctx_train)
    _add_vocab(writer, vocab_size)
    return finish_file(writer, tensors, partial, path)


def finish_file(writer: gguf.GGUFWriter, tensors: Dict[str, np.ndarray], partial: Path, path: Path) -> Path:
    """Add ``tensors``, write the file under its temporary name ``partial``, rename it to ``path``
    (a reader never sees a partial file); returns ``path``."""
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_tiny_pair(directory: PathLike, vocab_size: int = 32, arch: str = "llama",
                    target_seed: int = 0, draft_seed: int = 1) -> Tuple[Path, Path]:
    """A target and a draft model with the same vocabulary and different random weights.

    Returns ``(target_path, draft_path)``: ``tiny-target.gguf`` and ``tiny-draft.gguf`` in
    ``directory`` (created if needed). The draft has half the target's width, like a real pair.
    """
    if target_seed == draft_seed:
        raise ValueError("target_seed == draft_seed would make the draft equal the target")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = write_tiny_gguf(directory / "tiny-target.gguf", vocab_size=vocab_size, n_embd=32,
                             seed=target_seed, arch=arch)
    draft = write_tiny_gguf(directory / "tiny-draft.gguf", vocab_size=vocab_size, n_embd=16,
                            seed=draft_seed, arch=arch)
    return target, draft


def tokenize(path: PathLike, text: str, add_bos: bool = True) -> List[int]:
    """``text`` tokenized by llama.cpp with the model's vocabulary (vocab-only load)."""
    import llama_cpp

    with _loaded(path, vocab_only=True) as (model, _):
        vocab = llama_cpp.llama_model_get_vocab(model)
        data = text.encode()
        buffer = (llama_cpp.llama_token * (len(data) + 2))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buffer, len(buffer), add_bos, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n}) on {text!r}")
        return list(buffer[:n])


def logits_of(path: PathLike, tokens: Sequence[int]) -> np.ndarray:
    """The model's logits after each prefix of ``tokens``: shape (len(tokens), vocab_size).

    Row ``i`` is the next-token logits given ``tokens[:i + 1]``, from one llama_decode of the whole
    batch (F32 weights: equal to one-token-at-a-time decoding up to float rounding).
    """
    import llama_cpp

    if not tokens:
        raise ValueError("tokens is empty")
    with _loaded(path, n_ctx=max(16, len(tokens))) as (model, ctx):
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            return np.stack([
                np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                for i in range(len(tokens))]).astype(np.float64)
        finally:
            llama_cpp.llama_batch_free(batch)


@contextlib.contextmanager
def _loaded(path: PathLike, n_ctx: int = 16, vocab_only: bool = False) -> Iterator[Tuple[Any, Any]]:
    """(model, context) loaded with the low-level API, freed on exit; context None if vocab_only."""
    import llama_cpp

    model_params = llama_cpp.llama_model_default_params()
    model_params.vocab_only = vocab_only
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    ctx = None
    try:
        if not vocab_only:
            ctx_params = llama_cpp.llama_context_default_params()
            ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = n_ctx
            ctx_params.n_threads = ctx_params.n_threads_batch = 1  # tiny: threads only cost
            ctx = llama_cpp.llama_init_from_model(model, ctx_params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {path}")
        yield model, ctx
    finally:
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
