"""Tiny EAGLE-3 heads as their trainers write them (config.json + safetensors), for the tests of
``gemma-spec-eagle3-convert``, and a target GGUF of any layer count to convert them for.

    head_dir = write_head(tmp_path / "h", "speculators", layers=[3, 6, 9])
    target = write_target_header(tmp_path / "target.gguf", n_layer=12)

The weights are :mod:`tiny_eagle3`'s random head (``head_tensors(False, seed)``; 64 wide, 2 x 32
heads, 1 KV head, a 217-token draft vocabulary: ~290 KB, ~355 KB with an own token embedding),
written in Hugging Face's names and rotary layout with ``d2t`` as offsets, so that converting any
layout must give the GGUF that :func:`tiny_eagle3.write_eagle3_head` writes directly. The layouts,
from the trainers' documented schemas (no trainer code is copied here):

- ``native``: what llama.cpp's ``convert_hf_to_gguf.py`` reads: a flat Llama config with
  ``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size`` and a top-level
  ``eagle_aux_hidden_state_layer_ids`` in llama.cpp's numbering (id i < n: the input of target layer
  i, id n: its final state); tensors ``midlayer.*``;
- ``speculators`` (vllm-project/speculators, ``Eagle3SpeculatorConfig``): ``speculators_model_type:
  eagle3``, the decoder layer's Llama config under ``transformer_layer_config``, top-level
  ``draft_vocab_size``, ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (vLLM's numbering: the same as
  llama.cpp's below n) and ``speculators_config`` (algorithm, proposal methods, the verifier's
  ``name_or_path`` and ``architectures``); tensors ``layers.0.*``, and ``embed_tokens`` (speculators
  saves the verifier's embedding with the head);
- ``specforge`` (sgl-project/SpecForge, ``configs/*-eagle3.json`` and its SGLang export): a flat
  ``LlamaForCausalLMEagle3`` config with ``target_model_type`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's numbering (id i: the output of
  target layer i = the input of layer i + 1, so the ids written are llama.cpp's minus one);
  tensors ``midlayer.*``, no ``embed_tokens``.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, Optional, Sequence

import gguf
import numpy as np

from support.tiny_eagle3 import RANDOM_HEAD_DIM, RANDOM_HEADS, head_tensors
from support.tiny_gemma4 import TARGET_ARCH, TARGET_EMBD, VOCAB_SIZE
from support.tiny_gguf import _add_vocab

LAYOUTS = ("native", "speculators", "specforge")
#: where each layout puts the decoder layer's tensors
LAYER_PREFIX = {"native": "midlayer.", "speculators": "layers.0.", "specforge": "midlayer."}
#: GGUF layer names (after blk.0.) -> Hugging Face names (after the layer prefix)
HF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "attn_norm_2": "hidden_norm",
            "ffn_norm": "post_attention_layernorm"}
HF_HEAD = {"fc.weight": "fc.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
#: the decoder layer's Llama config of the tiny random head
LAYER_CONFIG = dict(hidden_size=TARGET_EMBD, num_attention_heads=RANDOM_HEADS, num_key_value_heads=1,
                    head_dim=RANDOM_HEAD_DIM, intermediate_size=2 * TARGET_EMBD, rms_norm_eps=1e-6,
                    rope_theta=10000.0, max_position_embeddings=4096, num_hidden_layers=1,
                    hidden_act="silu", vocab_size=VOCAB_SIZE, model_type="llama")
SEED = 2


def rotary_rows_to_hf(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of the converter's reordering: ggml's adjacent pairs -> HF's two halves."""
    half = weights.shape[0] // n_heads // 2
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_tensors(layer_prefix: str, seed: int = SEED, embed: bool = False,
               head_prefix: str = "") -> Dict[str, np.ndarray]:
    """The tiny random head's tensors as a trainer saves them: HF names (the decoder layer's
    after ``layer_prefix``, the head's own after ``head_prefix``), HF rotary rows, ``d2t`` as
    offsets, a boolean ``t2d``; ``embed``: with a token embedding (``embed_tokens``)."""
    tensors, n_head, _ = head_tensors(False, seed)
    out: Dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name.startswith("blk.0."):
            short = name[len("blk.0."):-len(".weight")]
            if short == "attn_q":
                value = rotary_rows_to_hf(value, n_head)
            elif short == "attn_k":
                value = rotary_rows_to_hf(value, 1)
            out[f"{layer_prefix}{HF_LAYER[short]}.weight"] = value
        elif name == "d2t":
            out["d2t"] = value - np.arange(value.size)  # offsets
            t2d = np.zeros(VOCAB_SIZE, dtype=bool)
            t2d[value] = True
            out["t2d"] = t2d
        else:
            out[head_prefix + HF_HEAD[name]] = value
    if embed:
        rng = np.random.default_rng(seed + 100)
        out[head_prefix + "embed_tokens.weight"] = rng.standard_normal((VOCAB_SIZE, TARGET_EMBD)).astype(np.float32)
    return out


def direct_tensors(seed: int = SEED, embed: bool = False) -> Dict[str, np.ndarray]:
    """What converting :func:`hf_tensors` must give (GGUF names, F32, ``d2t`` absolute)."""
    tensors, _, _ = head_tensors(False, seed)
    if embed:
        tensors["token_embd.weight"] = hf_tensors("layers.0.", seed, embed=True)["embed_tokens.weight"]
    return tensors


def write_safetensors_bf16(path: Path, tensors: Dict[str, np.ndarray]) -> None:
    """Float tensors as BF16 (truncated F32), the rest as they are: the safetensors layout written
    by hand, since numpy (and so safetensors' numpy API) has no bfloat16."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(bool): "BOOL"}
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        if value.dtype == np.float32:
            data, dtype = (value.view(np.uint32) >> 16).astype("<u2").tobytes(), "BF16"
        else:
            data, dtype = value.tobytes(), names[value.dtype]
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def head_config(layout: str, layers: Optional[Sequence[int]], draft_vocab_size: int) -> Dict[str, object]:
    """config.json of the tiny head in ``layout``; ``layers``: its target layers in llama.cpp's
    numbering, written in the layout's own (None: none written, the trainers' default)."""
    if layout == "speculators":
        config: Dict[str, object] = dict(
            speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
            transformer_layer_config=dict(LAYER_CONFIG, architectures=["LlamaForCausalLM"]),
            draft_vocab_size=draft_vocab_size, norm_before_residual=False, norm_before_fc=False,
            fc_norm=False, norm_output=False, target_hidden_size=None, embed_requires_grad=False,
            speculators_config=dict(
                algorithm="eagle3", default_proposal_method="greedy",
                proposal_methods=[dict(proposal_type="greedy", speculative_tokens=3, verifier_accept_k=1,
                                       accept_tolerance=0.0)],
                verifier=dict(name_or_path="tiny/gemma4-target", architectures=["Gemma4ForCausalLM"])),
            speculators_version="0.9.0")
        if layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in layers]
        return config
    config = dict(LAYER_CONFIG, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size)
    if layout == "specforge":
        config.update(target_model_type="gemma4_text", tie_word_embeddings=False, rope_scaling=None,
                      attention_bias=False)
        if layers is not None:
            config["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=[int(i) - 1 for i in layers])
    else:
        config["norm_before_residual"] = False
        if layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in layers]
    return config


def write_head(directory: Path, layout: str, layers: Optional[Sequence[int]] = (0, 1, 2), seed: int = SEED,
               bf16: bool = False, embed: Optional[bool] = None, layer_prefix: Optional[str] = None,
               head_prefix: str = "", **config_changes: object) -> Path:
    """The tiny random head in ``layout`` (see the module docstring) in ``directory`` (created);
    ``layers`` in llama.cpp's numbering; ``embed`` (default: speculators' habit) with a token
    embedding; ``layer_prefix``/``head_prefix`` other tensor prefixes; ``config_changes`` update
    config.json's top level. Returns ``directory``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    embed = layout == "speculators" if embed is None else embed
    tensors = hf_tensors(LAYER_PREFIX[layout] if layer_prefix is None else layer_prefix, seed, embed, head_prefix)
    config = head_config(layout, layers, int(tensors["d2t"].size))
    config.update(config_changes)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if bf16:
        write_safetensors_bf16(directory / "model.safetensors", tensors)
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_target_header(path: Path, n_layer: int, n_embd: int = TARGET_EMBD, vocab_size: int = VOCAB_SIZE) -> Path:
    """A ``gemma4`` GGUF with what the converter reads of a target (its architecture, width, layer
    count and tokenizer) and no weights: a target of ``n_layer`` layers without writing them
    (~5 KB). llama.cpp cannot load it; the converter only reads it."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), TARGET_ARCH)
    try:
        writer.add_uint32(f"{TARGET_ARCH}.embedding_length", n_embd)
        writer.add_uint32(f"{TARGET_ARCH}.block_count", n_layer)
        _add_vocab(writer, vocab_size)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def hf_named(tensors: Dict[str, np.ndarray], n_head: int, n_head_kv: int, layout: str = "specforge",
             vocab_size: int = VOCAB_SIZE) -> Dict[str, np.ndarray]:
    """A head's tensors in GGUF names (any sizes, ``d2t`` absolute) as a trainer saves them in
    ``layout``: HF names, HF rotary rows, ``d2t`` as offsets and a boolean ``t2d`` over
    ``vocab_size`` tokens; what :func:`hf_tensors` does for the tiny head, for any head."""
    prefix = LAYER_PREFIX[layout]
    out: Dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name.startswith("blk.0."):
            short = name[len("blk.0."):-len(".weight")]
            if short in ("attn_q", "attn_k"):
                value = rotary_rows_to_hf(value, n_head if short == "attn_q" else n_head_kv)
            out[f"{prefix}{HF_LAYER[short]}.weight"] = np.ascontiguousarray(value)
        elif name == "d2t":
            out["d2t"] = (value - np.arange(value.size)).astype(np.int64)
            t2d = np.zeros(vocab_size, dtype=bool)
            t2d[value] = True
            out["t2d"] = t2d
        else:
            out[HF_HEAD[name]] = np.ascontiguousarray(value)
    return out


def specforge_config(layer_config: Dict[str, object], layers: Sequence[int], draft_vocab_size: int,
                     target_model_type: str) -> Dict[str, object]:
    """config.json of a head in SpecForge's layout: ``layer_config`` (hidden_size, heads, head_dim,
    intermediate_size, vocab_size...) flat, ``layers`` in llama.cpp's numbering written as SGLang's
    (layer outputs: minus one)."""
    config = dict(layer_config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size,
                  target_model_type=target_model_type, tie_word_embeddings=False, rope_scaling=None,
                  attention_bias=False, num_hidden_layers=1, hidden_act="silu", model_type="llama")
    config["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=[int(i) - 1 for i in layers])
    return config


def write_hf_head(directory: Path, tensors: Dict[str, np.ndarray], config: Dict[str, object]) -> Path:
    """``config.json`` and ``model.safetensors`` (HF-named ``tensors``) in ``directory`` (created)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
