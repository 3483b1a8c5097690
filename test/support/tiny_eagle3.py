"""Tiny ``eagle3`` heads for the tiny ``gemma4`` targets of :mod:`tiny_gemma4`, written with gguf-py.

    target, head = write_eagle3_pair(tmp_path)                  # random weights
    target, head = write_eagle3_pair(tmp_path, agreeing=True)   # the head predicts the target

No real head or Gemma 4 weights can be had here, so these files carry what llama.cpp's eagle3 loader
requires (llama-cpp-python 0.3.36, llama.cpp 0c1e57098) and nothing more: F32, one decoder layer,
the target's vocabulary (tokenizer keys), ``eagle3.target_layers`` [0, 1, 2] of the two-layer target
(its two layer inputs and, id 2 = its layer count, its final post-norm state), a reduced draft
vocabulary (``d2t``, absolute target ids), an own output head, and no token embedding (the head
borrows the target's through ``ctx_other``, as public heads for Gemma 4 do not).

**random** (``agreeing=False``): weights ~ N(0, 1/fan_in), draft vocabulary = every ordinary token
but the multiples of 7 (a reduced vocabulary whose gaps show as -inf logits); the head is right
about as often as chance, so nearly every draft is rejected and the head's cache is rolled back at
every step.

**agreeing** (``agreeing=True``), for the agreeing target (next token = ``succ(current)``): built so
that the head's argmax is ``succ`` of the token it is fed at every step, so drafts are accepted:

- ``attn_norm_2`` is zero and ``norm_before_residual`` is set, so g (the target's features, and the
  head's own hidden row during a draft chain) reaches neither attention nor the residual: the head
  depends on the fed token alone;
- attention reads the token half of its input: Q = 10 x, K = V = x, one head of the full width, so
  a position attends to itself (a score of 80 against |<E_s, E_t>| x 80 << 80 for other tokens, and
  RoPE leaves a position's score with itself unrotated) and to earlier copies of its token, whose
  value is the same: the output is 8 E[t] (the RMS-normed unit embedding row);
- the FFN adds nothing (its down projection is zero), and the output head's row for ``succ(t)`` is
  3 E[t] (rows over the draft vocabulary = the ordinary tokens), so by Cauchy-Schwarz the argmax is
  ``succ(t)`` with a margin that makes its probability ~1 (p_min 0.75 never stops a draft).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import gguf
import numpy as np

from support.tiny_gemma4 import (FIRST_ORDINARY, TARGET_EMBD, VOCAB_SIZE, agreeing_head,
                                 write_gemma4_target)
from support.tiny_gguf import PathLike, _add_vocab, finish_file

HEAD_ARCH = "eagle3"
#: the tiny gemma4 target has 2 layers: its two layer inputs and (id 2) its final post-norm state
TARGET_LAYERS = (0, 1, 2)
RANDOM_HEADS, RANDOM_HEAD_DIM = 2, 32  # 1 KV head: grouped-query attention, as public heads
AGREEING_SCORE_SCALE = 10.0  # Q = 10 x: self-attention wins by a wide margin
AGREEING_OUTPUT_SCALE = 3.0  # logit margin: the right token's probability is ~1


def random_draft_vocabulary() -> np.ndarray:
    """The random head's ``d2t``: ordinary token ids that are no multiple of 7."""
    ids = np.arange(FIRST_ORDINARY, VOCAB_SIZE)
    return ids[ids % 7 != 0].astype(np.int64)


def agreeing_draft_vocabulary() -> np.ndarray:
    """The agreeing head's ``d2t``: every ordinary token (``succ`` cycles through all of them)."""
    return np.arange(FIRST_ORDINARY, VOCAB_SIZE, dtype=np.int64)


def _matrix(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    """An (out, in) numpy matrix = ggml's {in, out}, std 1/sqrt(in)."""
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


def head_tensors(agreeing: bool, seed: int, n_embd: int = TARGET_EMBD,
                 hidden_size: int = TARGET_EMBD) -> Tuple[Dict[str, np.ndarray], int, int]:
    """(tensors in GGUF names, n_head, head_dim) of a tiny head; ``hidden_size`` is the target's
    (the width of each feature row). Also used by the converter's tests, in HF layout."""
    rng = np.random.default_rng(seed)
    n_ff = 2 * n_embd
    ones = np.ones(n_embd, dtype=np.float32)
    if agreeing:
        n_head, head_dim = 1, n_embd
        d2t = agreeing_draft_vocabulary()
        eye = np.eye(n_embd, dtype=np.float32)
        token_half = np.zeros((n_embd, 2 * n_embd), dtype=np.float32)
        token_half[:, :n_embd] = eye
        embd, output = agreeing_head()
        blocks = {"attn_q": AGREEING_SCORE_SCALE * token_half, "attn_k": token_half.copy(),
                  "attn_v": token_half.copy(), "attn_output": eye.copy(),
                  "attn_norm_2": np.zeros(n_embd, dtype=np.float32),
                  "ffn_down": np.zeros((n_embd, n_ff), dtype=np.float32)}
        head = AGREEING_OUTPUT_SCALE * output[d2t]
    else:
        n_head, head_dim = RANDOM_HEADS, RANDOM_HEAD_DIM
        d2t = random_draft_vocabulary()
        blocks = {"attn_q": _matrix(rng, n_head * head_dim, 2 * n_embd),
                  "attn_k": _matrix(rng, head_dim, 2 * n_embd),
                  "attn_v": _matrix(rng, head_dim, 2 * n_embd),
                  "attn_output": _matrix(rng, n_embd, n_head * head_dim),
                  "attn_norm_2": ones.copy(), "ffn_down": _matrix(rng, n_embd, n_ff)}
        head = _matrix(rng, len(d2t), n_embd)
    tensors = {"fc.weight": _matrix(rng, n_embd, len(TARGET_LAYERS) * hidden_size),
               "output_norm.weight": ones.copy(), "output.weight": head, "d2t": d2t,
               "blk.0.attn_norm.weight": ones.copy(), "blk.0.ffn_norm.weight": ones.copy(),
               "blk.0.ffn_gate.weight": _matrix(rng, n_ff, n_embd),
               "blk.0.ffn_up.weight": _matrix(rng, n_ff, n_embd)}
    tensors.update({f"blk.0.{name}.weight": value for name, value in blocks.items()})
    return tensors, n_head, head_dim


def write_eagle3_head(path: PathLike, agreeing: bool = False, seed: int = 2,
                      layers: Sequence[int] = TARGET_LAYERS, hidden_size: int = TARGET_EMBD,
                      n_embd: int = TARGET_EMBD, vocab_size: int = VOCAB_SIZE,
                      n_ctx_train: int = 4096, architecture: str = HEAD_ARCH) -> Path:
    """A tiny ``eagle3`` head (see the module docstring). ``layers`` (its target layer ids),
    ``hidden_size`` (its ``target_hidden_size``), ``n_embd`` and ``vocab_size`` other than the tiny
    target's make a head meant for another target; ``architecture`` another string makes a file
    that is no EAGLE-3 head."""
    if agreeing and (hidden_size, n_embd, vocab_size) != (TARGET_EMBD, TARGET_EMBD, VOCAB_SIZE):
        raise ValueError("an agreeing head is made for the agreeing target's sizes")
    tensors, n_head, head_dim = head_tensors(agreeing, seed, n_embd, hidden_size)
    if vocab_size < VOCAB_SIZE:
        keep = tensors["d2t"] < vocab_size
        tensors["d2t"], tensors["output.weight"] = tensors["d2t"][keep], tensors["output.weight"][keep]
    return _write_head(Path(path), tensors, n_head, head_dim, agreeing, layers, hidden_size, n_embd,
                       vocab_size, n_ctx_train, architecture)


def _write_head(path: Path, tensors: Dict[str, np.ndarray], n_head: int, head_dim: int,
                norm_before_residual: bool, layers: Sequence[int] = TARGET_LAYERS,
                hidden_size: int = TARGET_EMBD, n_embd: int = TARGET_EMBD,
                vocab_size: int = VOCAB_SIZE, n_ctx_train: int = 4096,
                architecture: str = HEAD_ARCH) -> Path:
    """Write a head's keys (the eagle3 hyper-parameters, the target's vocabulary) and tensors."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, architecture)
    writer.add_name(path.stem)
    arch = architecture
    for key, value in ((f"{arch}.context_length", n_ctx_train), (f"{arch}.embedding_length", n_embd),
                       (f"{arch}.block_count", 1), (f"{arch}.feed_forward_length", 2 * n_embd),
                       (f"{arch}.attention.head_count", n_head), (f"{arch}.attention.head_count_kv", 1),
                       (f"{arch}.attention.key_length", head_dim),
                       (f"{arch}.attention.value_length", head_dim),
                       (f"{arch}.rope.dimension_count", head_dim),
                       (f"{arch}.target_hidden_size", hidden_size)):
        writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_array(f"{arch}.target_layers", [int(layer) for layer in layers])
    writer.add_bool(f"{arch}.norm_before_residual", norm_before_residual)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(writer, vocab_size)
    return finish_file(writer, tensors, partial, path)


def write_eagle3_pair(directory: PathLike, agreeing: bool = False,
                      head_seed: Optional[int] = None) -> Tuple[Path, Path]:
    """``(target, head)`` in ``directory`` (created if needed): random, or agreeing."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kind = "agreeing" if agreeing else "random"
    target = write_gemma4_target(directory / f"tiny-gemma4-{kind}.gguf", agreeing)
    head = write_eagle3_head(directory / f"tiny-gemma4-{kind}-eagle3.gguf", agreeing,
                             seed=2 if head_seed is None else head_seed)
    return target, head


def write_probe_head(path: PathLike, target: PathLike, feature: int) -> Path:
    """A head whose first draft token shows what one of its features holds, for a random target:
    g = that feature (``fc`` selects it), attention and FFN add nothing (zero output projections,
    ``norm_before_residual`` unset: the residual is g itself), no draft vocabulary, so the seed
    step's logits are its output head over RMS-normed g.

    - ``feature=0`` (the input of layer 0: Gemma's scaled token embedding E[t] sqrt(n_embd)): the
      output head is E with unit rows, so the argmax is the token at the seed pair's position,
      the context's last token before the pending one (Cauchy-Schwarz);
    - ``feature=2`` (the final post-norm state): the output head is the target's own, so the argmax
      is the target's greedy token there: the pending token itself.
    """
    reader = gguf.GGUFReader(str(target))
    weights = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors
               if t.name in ("token_embd.weight", "output.weight")}
    if feature == 0:
        embd = weights["token_embd.weight"]
        output = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    elif feature == len(TARGET_LAYERS) - 1:
        output = weights["output.weight"]
    else:
        raise ValueError(f"feature {feature}: a probe reads feature 0 or {len(TARGET_LAYERS) - 1}")
    tensors, _, _ = head_tensors(False, seed=3)
    n = TARGET_EMBD
    select = np.zeros((n, len(TARGET_LAYERS) * n), dtype=np.float32)
    select[:, feature * n:(feature + 1) * n] = np.eye(n, dtype=np.float32)
    del tensors["d2t"]
    tensors.update({"fc.weight": select, "output.weight": output.astype(np.float32),
                    "blk.0.attn_output.weight": np.zeros_like(tensors["blk.0.attn_output.weight"]),
                    "blk.0.ffn_down.weight": np.zeros_like(tensors["blk.0.ffn_down.weight"])})
    return _write_head(Path(path), tensors, RANDOM_HEADS, RANDOM_HEAD_DIM, norm_before_residual=False)
