"""Tiny Gemma 4 target + ``gemma4-assistant`` (MTP drafter) GGUFs for fast tests, written with gguf-py.

    target, assistant = write_gemma4_pair(tmp_path)                  # random weights
    target, assistant = write_gemma4_pair(tmp_path, agreeing=True)   # the assistant predicts the target

No real Gemma 4 weights can be had here, so these files carry what llama.cpp's loader requires of the
two architectures (llama-cpp-python 0.3.36, llama.cpp 0c1e57098) and nothing more: F32, two layers
each (a sliding-window layer, then a full-attention one: the assistant reads the target's cache of its
last layer of each kind), no per-layer embeddings, no shared-KV layers, no centroid head. The
vocabulary is :mod:`tiny_gguf`'s (byte-level BPE, one token per character), so prompts are text.

**random** (``agreeing=False``): weights ~ N(0, 1/fan_in); logits of both models have a standard
deviation of ~1, so sampling spreads over several tokens and the assistant's drafts are accepted
about as often as chance (~1 / vocabulary). The EOS row of both heads is zero (a logit of 0, the
median) so that greedy generation never stops before ``max_tokens``.

**agreeing** (``agreeing=True``): built so that the assistant's argmax is the target's at every step
(acceptance ~1), to prove that accepted drafts flow through the whole path:

- the target's layers add nothing (attention output and FFN down projections are zero, and a zero
  vector stays zero through RMS norm), so its last hidden state is its input embedding E[t] scaled,
  and its next token depends on the current token only;
- its output head is E permuted: ``output[succ(t)] = E[t]`` with unit-norm rows, so by
  Cauchy-Schwarz the argmax of ``output @ E[t]`` is ``succ(t)``, one long cycle over the ordinary
  tokens (no repetition within a few hundred tokens, so n-gram lookup has nothing to find);
- the assistant's pre-projection passes the target's token embedding straight through (an identity
  block; the hidden-state half is ignored), its layers add nothing either, and its head (its tied
  token embedding) is the target's output head, zero-padded to its width. RMS norm only scales,
  so the assistant's argmax at every draft step is ``succ`` of the token it was fed, as the target's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import gguf
import numpy as np

from support.tiny_gguf import EOS_ID, PathLike, _add_vocab, finish_file

TARGET_ARCH = "gemma4"
ASSISTANT_ARCH = "gemma4-assistant"  # llama.cpp's name (hyphen); HF's gemma4_assistant does not load
VOCAB_SIZE = 256
TARGET_EMBD = 64  # hidden size of the target = the assistant's embedding_length_out
HEAD_DIM = 16
N_HEAD, N_HEAD_KV = 2, 1  # the assistant's Q heads attend to the target's KV heads
SLIDING_WINDOW = 64  # shorter than the tests' generations: the window cache wraps
#: sliding-window layer first, full attention last (the assistant's share map needs both kinds)
SWA_PATTERN = (True, False)
FIRST_ORDINARY = 3  # ids below are <unk>, <s>, </s>


def _matrix(rng: np.random.Generator, n_out: int, n_in: int, std: Optional[float] = None) -> np.ndarray:
    """An (out, in) numpy matrix = ggml's {in, out}; std 1/sqrt(in) by default."""
    scale = 1.0 / np.sqrt(n_in) if std is None else std
    return (rng.standard_normal((n_out, n_in)) * scale).astype(np.float32)


def _ones(*shape: int) -> np.ndarray:
    return np.ones(shape, dtype=np.float32)


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def _common_keys(writer: gguf.GGUFWriter, arch: str, n_embd: int, n_ff: int, n_ctx_train: int,
                 vocab_size: int) -> None:
    """The hyper-parameters both architectures read (the assistant's must match the target's
    attention shapes: it attends over the target's cache)."""
    writer.add_uint32(f"{arch}.context_length", n_ctx_train)
    writer.add_uint32(f"{arch}.embedding_length", n_embd)
    writer.add_uint32(f"{arch}.block_count", len(SWA_PATTERN))
    writer.add_uint32(f"{arch}.feed_forward_length", n_ff)
    writer.add_uint32(f"{arch}.attention.head_count", N_HEAD)
    writer.add_uint32(f"{arch}.attention.head_count_kv", N_HEAD_KV)
    for suffix in ("", "_swa"):
        writer.add_uint32(f"{arch}.attention.key_length{suffix}", HEAD_DIM)
        writer.add_uint32(f"{arch}.attention.value_length{suffix}", HEAD_DIM)
        writer.add_uint32(f"{arch}.rope.dimension_count{suffix}", HEAD_DIM)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_float32(f"{arch}.rope.freq_base_swa", 1e4)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{arch}.attention.sliding_window", SLIDING_WINDOW)
    writer.add_array(f"{arch}.attention.sliding_window_pattern", list(SWA_PATTERN))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(writer, vocab_size)


def _write(path: Path, arch: str, keys: Dict[str, int], tensors: Dict[str, np.ndarray],
           n_embd: int, n_ff: int, n_ctx_train: int, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write one file under a temporary name, then rename it (a reader never sees a partial file)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    writer.add_name(path.stem)
    _common_keys(writer, arch, n_embd, n_ff, n_ctx_train, vocab_size)
    for key, value in keys.items():
        writer.add_uint32(key, value)
    return finish_file(writer, tensors, partial, path)


def successor_cycle(seed: int = 0) -> np.ndarray:
    """``succ[t]``: the agreeing target's next token after ``t``: one cycle through the ordinary
    tokens in a seeded random order (control tokens map to the first of that order)."""
    order = np.random.default_rng(seed).permutation(np.arange(FIRST_ORDINARY, VOCAB_SIZE))
    succ = np.full(VOCAB_SIZE, order[0], dtype=np.int64)
    succ[order] = np.roll(order, -1)
    return succ


def agreeing_head() -> Tuple[np.ndarray, np.ndarray]:
    """(token embedding, output head) of the agreeing target, fixed: the agreeing assistant's head
    is the same output head. Rows of E have unit norm; ``output[succ[t]] = E[t]``."""
    embd = np.random.default_rng(7).standard_normal((VOCAB_SIZE, TARGET_EMBD))
    embd = (embd / np.linalg.norm(embd, axis=1, keepdims=True)).astype(np.float32)
    output = _zeros(VOCAB_SIZE, TARGET_EMBD)  # control tokens: logit 0, below succ(t)'s
    ordinary = np.arange(FIRST_ORDINARY, VOCAB_SIZE)
    output[successor_cycle()[ordinary]] = embd[ordinary]
    return embd, output


def _target_tensors(agreeing: bool, rng: np.random.Generator, n_ff: int) -> Dict[str, np.ndarray]:
    d = TARGET_EMBD
    if agreeing:
        embd, output = agreeing_head()
    else:
        embd = _matrix(rng, VOCAB_SIZE, d)  # x 8 at the input: RMS ~1, as each layer's normed output
        output = _matrix(rng, VOCAB_SIZE, d)  # the final RMS norm gives |h| ~ sqrt(d): logit std ~1
        output[EOS_ID] = 0.0
    tensors = {"token_embd.weight": embd, "output.weight": output,
               "output_norm.weight": _ones(d), "rope_freqs.weight": _ones(HEAD_DIM // 2)}
    return _add_layers(tensors, rng, d, n_ff, agreeing, with_kv=True)


def _add_layers(tensors: Dict[str, np.ndarray], rng: np.random.Generator, n_embd: int, n_ff: int,
                agreeing: bool, with_kv: bool) -> Dict[str, np.ndarray]:
    """The blocks of either model: the target's with K and V, the assistant's Q-only (it reads the
    target's cache). Agreeing: attention output and FFN down projections are zero (adds nothing)."""
    q_dim, kv_dim = HEAD_DIM * N_HEAD, HEAD_DIM * N_HEAD_KV
    for layer in range(len(SWA_PATTERN)):
        block = f"blk.{layer}."
        tensors.update({
            block + "attn_norm.weight": _ones(n_embd),
            block + "attn_q.weight": _matrix(rng, q_dim, n_embd),
            block + "attn_output.weight": _zeros(n_embd, q_dim) if agreeing else _matrix(rng, n_embd, q_dim),
            block + "attn_q_norm.weight": _ones(HEAD_DIM),
            block + "post_attention_norm.weight": _ones(n_embd),
            block + "layer_output_scale.weight": _ones(1),
            block + "ffn_norm.weight": _ones(n_embd),
            block + "ffn_gate.weight": _matrix(rng, n_ff, n_embd),
            block + "ffn_up.weight": _matrix(rng, n_ff, n_embd),
            block + "ffn_down.weight": _zeros(n_embd, n_ff) if agreeing else _matrix(rng, n_embd, n_ff),
            block + "post_ffw_norm.weight": _ones(n_embd),
        })
        if with_kv:
            tensors.update({block + "attn_k.weight": _matrix(rng, kv_dim, n_embd),
                            block + "attn_v.weight": _matrix(rng, kv_dim, n_embd),
                            block + "attn_k_norm.weight": _ones(HEAD_DIM)})
    return tensors


def _assistant_tensors(agreeing: bool, rng: np.random.Generator, n_embd: int, n_ff: int,
                       hidden_size: int, target_output: Optional[np.ndarray],
                       vocab_size: int) -> Dict[str, np.ndarray]:
    if agreeing:
        head = _zeros(VOCAB_SIZE, n_embd)
        head[:, :TARGET_EMBD] = target_output
        pre = _zeros(n_embd, 2 * hidden_size)
        pre[:TARGET_EMBD, :TARGET_EMBD] = np.eye(TARGET_EMBD, dtype=np.float32)  # token half only
    else:
        head = _matrix(rng, vocab_size, n_embd)
        head[EOS_ID] = 0.0
        pre = _matrix(rng, n_embd, 2 * hidden_size)
    tensors = {"token_embd.weight": head, "output_norm.weight": _ones(n_embd),
               "rope_freqs.weight": _ones(HEAD_DIM // 2),
               "nextn.pre_projection.weight": pre,
               "nextn.post_projection.weight": _matrix(rng, hidden_size, n_embd)}
    return _add_layers(tensors, rng, n_embd, n_ff, agreeing, with_kv=False)


def write_gemma4_target(path: PathLike, agreeing: bool = False, seed: int = 0,
                        n_ctx_train: int = 4096) -> Path:
    """A tiny ``gemma4`` target (see the module docstring for ``agreeing``)."""
    n_ff = 2 * TARGET_EMBD
    tensors = _target_tensors(agreeing, np.random.default_rng(seed), n_ff)
    keys = {f"{TARGET_ARCH}.embedding_length_per_layer_input": 0,  # required key; 0 = no PLE
            f"{TARGET_ARCH}.attention.shared_kv_layers": 0}
    return _write(Path(path), TARGET_ARCH, keys, tensors, TARGET_EMBD, n_ff, n_ctx_train)


def write_gemma4_assistant(path: PathLike, agreeing: bool = False, seed: int = 1,
                           hidden_size: int = TARGET_EMBD, n_ctx_train: int = 4096,
                           vocab_size: int = VOCAB_SIZE) -> Path:
    """A tiny ``gemma4-assistant`` for a target of ``hidden_size`` (its ``embedding_length_out``;
    another value, or another ``vocab_size``, makes an assistant meant for another target).
    ``agreeing``: its head is the agreeing target's (:func:`agreeing_head`)."""
    if agreeing and (hidden_size, vocab_size) != (TARGET_EMBD, VOCAB_SIZE):
        raise ValueError("an agreeing assistant is made for the agreeing target's sizes")
    n_embd = TARGET_EMBD + 32  # llama.cpp refuses an assistant as wide as its target
    n_ff = 2 * n_embd
    target_output = agreeing_head()[1] if agreeing else None
    tensors = _assistant_tensors(agreeing, np.random.default_rng(seed), n_embd, n_ff, hidden_size,
                                 target_output, vocab_size)
    keys = {f"{ASSISTANT_ARCH}.embedding_length_out": hidden_size,
            f"{ASSISTANT_ARCH}.nextn_predict_layers": len(SWA_PATTERN)}
    return _write(Path(path), ASSISTANT_ARCH, keys, tensors, n_embd, n_ff, n_ctx_train, vocab_size)


def write_gemma4_pair(directory: PathLike, agreeing: bool = False) -> Tuple[Path, Path]:
    """``(target, assistant)`` in ``directory`` (created if needed): random, or agreeing."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kind = "agreeing" if agreeing else "random"
    return (write_gemma4_target(directory / f"tiny-gemma4-{kind}.gguf", agreeing),
            write_gemma4_assistant(directory / f"tiny-gemma4-{kind}-assistant.gguf", agreeing))
