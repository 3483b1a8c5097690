"""``gemma-spec-eagle3-convert``: an EAGLE-3 head as published -> the head's GGUF for llama.cpp.

    gemma-spec-eagle3-convert HEAD_DIR TARGET.gguf -o head.gguf [--outtype f16|f32]

``HEAD_DIR`` holds a head in one of the formats heads are published in: ``config.json`` and
``*.safetensors`` of vllm-project/speculators (``"speculators_model_type": "eagle3"``, the decoder
layer's Llama config under ``transformer_layer_config``, tensors ``layers.0.*``) or of SpecForge /
EAGLE's own trainers (``LlamaForCausalLMEagle3``, a flat Llama config with ``draft_vocab_size``,
tensors ``midlayer.*``). ``TARGET.gguf`` is the GGUF of the model the head drafts for: its
tokenizer keys are copied into the head (llama.cpp loads a vocabulary with every model) and its
sizes give the defaults the head's config may leave out (the target's hidden size; the target
layers [2, n/2, n - 3]) and the checks (the head reads layers the target has; its draft vocabulary
is target ids). llama.cpp's own converter needs the target's Hugging Face files instead, which are
gated for Gemma.

What changes on the way (the file format llama.cpp 0c1e57098 reads, ``eagle3`` architecture):
- tensor names: ``self_attn.{q,k,v,o}_proj`` -> ``blk.0.attn_{q,k,v,output}``,
  ``mlp.{gate,up,down}_proj`` -> ``blk.0.ffn_*``, ``input_layernorm`` -> ``attn_norm``,
  ``hidden_norm`` -> ``attn_norm_2``, ``post_attention_layernorm`` -> ``ffn_norm``, ``norm`` ->
  ``output_norm``, ``lm_head`` -> ``output``, ``embed_tokens`` -> ``token_embd``, ``input_norm``
  -> ``enc.output_norm`` (``norm_before_fc``); ``t2d`` is dropped (llama.cpp does not read it);
- Q and K rows are reordered per head from the Hugging Face rotary layout (each head's rotated
  dimensions as two halves) to ggml's (adjacent pairs), as for every Llama-family conversion;
- ``d2t`` is stored by trainers as offsets (draft id i -> target id i + d2t[i]) and by llama.cpp as
  absolute target ids (I64), checked in range and without duplicates;
- BF16 weights (numpy has no bfloat16) are widened to F32 before ``--outtype``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

PROG = "gemma-spec-eagle3-convert"
ARCH = "eagle3"
#: ``architectures`` of flat (SpecForge-style) EAGLE-3 configs; speculators' have their own key.
FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel",
                      "Eagle3Speculator")
#: HF names of the decoder layer's tensors (after its prefix) -> GGUF names (after ``blk.0.``)
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
#: prefixes of the one decoder layer in the published formats
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
#: HF names of the head's own tensors -> GGUF names (None: not used by llama.cpp, dropped)
HEAD_TENSORS: Dict[str, Optional[str]] = {
    "fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight", "input_norm.weight": "enc.output_norm.weight",
    "d2t": "d2t", "t2d": None,
}


class ConversionError(ValueError):
    """The head directory or the target cannot make a head's GGUF (the message says why)."""


# -- reading the published head ------------------------------------------------------------------------
def head_config(directory: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the EAGLE-3 keys, the decoder layer's Llama config) of ``directory/config.json``."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from None
    kind = config.get("speculators_model_type")
    if kind not in (None, "eagle3"):
        raise ConversionError(f"{path} is no EAGLE-3 head: its speculators_model_type is {kind!r}")
    if kind == "eagle3":
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConversionError(f"{path}: a speculators config without transformer_layer_config")
    elif set(config.get("architectures") or ()) & set(FLAT_ARCHITECTURES) and "draft_vocab_size" in config:
        layer = config
    else:
        raise ConversionError(f"{path} is no EAGLE-3 head: expected speculators_model_type 'eagle3', "
                              f"or architectures {'/'.join(FLAT_ARCHITECTURES)} with draft_vocab_size")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ConversionError(f"{path}: num_hidden_layers {layer.get('num_hidden_layers')}; an EAGLE-3 "
                              "head has one decoder layer")
    activation = layer.get("hidden_act") or layer.get("hidden_activation") or "silu"
    if activation != "silu":
        raise ConversionError(f"{path}: activation {activation!r}; llama.cpp's eagle3 graph runs a "
                              "SiLU-gated FFN")
    return config, layer


def read_safetensors(path: Path) -> Iterator[Tuple[str, np.ndarray]]:
    """(name, array) of each tensor of a safetensors file. F32/F16/I64/I32 through the
    ``safetensors`` package's numpy API; BF16 (which numpy lacks) from the file's own layout (an
    8-byte little-endian header size, a JSON header of dtype, shape and data offsets, the data),
    widened to F32 by putting its 16 bits above 16 zero bits."""
    from safetensors import safe_open  # noqa: WPS433  a tool's dependency, not the node's

    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    start = 8 + size
    with safe_open(str(path), framework="np") as tensors:
        for name in tensors.keys():
            info = header[name]
            if info["dtype"] != "BF16":
                yield name, tensors.get_tensor(name)
                continue
            begin, end = info["data_offsets"]
            with open(path, "rb") as fh:
                fh.seek(start + begin)
                raw = np.frombuffer(fh.read(end - begin), dtype="<u2")
            yield name, (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def head_tensors(directory: Path) -> Dict[str, np.ndarray]:
    """Every tensor of the head's safetensors files, by HF name."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"no *.safetensors in {directory}")
    tensors: Dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(read_safetensors(path))
    return tensors


# -- the target ---------------------------------------------------------------------------------------
class Target:
    """What the conversion needs of the target's GGUF: its sizes and its tokenizer keys."""

    def __init__(self, path: Path) -> None:
        import gguf  # noqa: WPS433

        try:
            reader = gguf.GGUFReader(str(path))
        except (OSError, ValueError) as error:
            raise ConversionError(f"cannot read the target {path}: {error}") from None
        fields = reader.fields
        self.architecture = str(fields["general.architecture"].contents())
        self.hidden_size = int(self._value(fields, f"{self.architecture}.embedding_length"))
        self.n_layer = int(self._value(fields, f"{self.architecture}.block_count"))
        self.tokenizer = {name: field for name, field in fields.items() if name.startswith("tokenizer.")}
        if "tokenizer.ggml.tokens" not in self.tokenizer:
            raise ConversionError(f"the target {path} has no tokenizer.ggml.tokens")
        self.n_vocab = len(self.tokenizer["tokenizer.ggml.tokens"].contents())

    @staticmethod
    def _value(fields: Dict[str, Any], key: str) -> Any:
        if key not in fields:
            raise ConversionError(f"the target GGUF has no {key}")
        return fields[key].contents()

    def copy_tokenizer(self, writer: Any) -> None:
        """The target's ``tokenizer.*`` keys, as they are, into ``writer``."""
        import gguf  # noqa: WPS433

        for name, field in self.tokenizer.items():
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
            else:
                writer.add_key_value(name, field.contents(), kind)


# -- the conversion -----------------------------------------------------------------------------------
def rotary_rows_to_ggml(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Q or K projection rows reordered per head from the Hugging Face rotary layout (the rotated
    dimensions of a head as two halves, rotate_half) to ggml's NORM rope (adjacent pairs).

    >>> rotary_rows_to_ggml(np.arange(8).reshape(8, 1), 2).ravel().tolist()
    [0, 2, 1, 3, 4, 6, 5, 7]
    """
    rows = weights.shape[0]
    half = rows // n_heads // 2
    return (weights.reshape(n_heads, 2, half, *weights.shape[1:]).swapaxes(1, 2)
            .reshape(weights.shape))


def absolute_d2t(offsets: np.ndarray, n_vocab: int) -> np.ndarray:
    """Draft-to-target ids as llama.cpp reads them: target id of draft id i = i + offsets[i].

    >>> absolute_d2t(np.array([3, 3, 4]), 8).tolist()
    [3, 4, 6]
    """
    ids = offsets.astype(np.int64).reshape(-1) + np.arange(offsets.size, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        raise ConversionError(f"d2t maps to target ids {ids.min()}..{ids.max()}, outside the target's "
                              f"vocabulary of {n_vocab}")
    if np.unique(ids).size != ids.size:
        raise ConversionError("d2t maps two draft ids to one target id")
    return ids


def target_layers(config: Dict[str, Any], target: Target) -> List[int]:
    """The head's target layer ids: its config's (top level, or SpecForge's ``eagle_config``), or
    the trainers' default [2, n / 2, n - 3]; each within 0..n (n = the final post-norm state)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or \
        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = target.n_layer
    layers = [int(i) for i in ids] if ids else [2, n // 2, n - 3]
    if len(layers) != 3 or min(layers) < 0 or max(layers) > n:
        raise ConversionError(f"target layers {layers}: an EAGLE-3 head reads 3 layers of the target's "
                              f"{n} (ids 0..{n})")
    return layers


def rope_factors(layer: Dict[str, Any], head_dim: int) -> Optional[np.ndarray]:
    """llama3 rope scaling as per-dimension frequency divisors (llama.cpp's ``rope_freqs``); None
    without scaling. The llama3 rule: wavelengths shorter than the original context / high factor
    keep their frequency, longer than original / low factor are divided by ``factor``, and those in
    between are blended linearly in original / wavelength."""
    scaling = layer.get("rope_scaling") or (layer.get("rope_parameters") or {})
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default").lower()
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConversionError(f"rope scaling {kind!r}: this converter knows llama3 scaling only")
    base = float(scaling.get("rope_theta", layer.get("rope_theta", 10000.0)))
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(tensors: Dict[str, np.ndarray], layer: Dict[str, Any], n_vocab: int,
                 outtype: str) -> Dict[str, np.ndarray]:
    """The head's tensors under llama.cpp's names and types (see the module docstring)."""
    n_head = int(layer["num_attention_heads"])
    n_head_kv = int(layer.get("num_key_value_heads", n_head))
    float_type = np.float16 if outtype == "f16" else np.float32
    out: Dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        prefix = next((p for p in LAYER_PREFIXES if name.startswith(p)), None)
        if prefix is not None and name[len(prefix):] in LAYER_TENSORS:
            short = name[len(prefix):]
            if short == "self_attn.q_proj.weight":
                value = rotary_rows_to_ggml(value, n_head)
            elif short == "self_attn.k_proj.weight":
                value = rotary_rows_to_ggml(value, n_head_kv)
            out["blk.0." + LAYER_TENSORS[short]] = value
        elif name.replace("model.", "", 1) in HEAD_TENSORS:
            gguf_name = HEAD_TENSORS[name.replace("model.", "", 1)]
            if gguf_name == "d2t":
                out[gguf_name] = absolute_d2t(value, n_vocab)
            elif gguf_name is not None:
                out[gguf_name] = value
        else:
            raise ConversionError(f"tensor {name!r} is none an EAGLE-3 head has (biases are not "
                                  "supported by llama.cpp's eagle3 graph)")
    for name, value in out.items():
        if name != "d2t":  # norms (1-D) stay F32, as llama.cpp's converters keep them
            out[name] = np.ascontiguousarray(value, dtype=float_type if value.ndim > 1 else np.float32)
    return out


def check_head(out: Dict[str, np.ndarray], layer: Dict[str, Any], hidden_size: int,
               target: Target) -> None:
    """Refuse a head llama.cpp would load and then could not run for this target."""
    missing = [name for name in ("fc.weight", "output_norm.weight", "blk.0.attn_q.weight",
                                 "blk.0.attn_norm_2.weight") if name not in out]
    if missing:
        raise ConversionError(f"the head has no {', '.join(missing)}")
    if int(layer["hidden_size"]) != target.hidden_size:
        raise ConversionError(f"the head's hidden size {layer['hidden_size']} is not the target's "
                              f"{target.hidden_size}: it borrows the target's embeddings (a head of "
                              "another model?)")
    if hidden_size != target.hidden_size:
        raise ConversionError(f"the head reads target features of size {hidden_size}, the target has "
                              f"{target.hidden_size}")
    if "d2t" in out and "output.weight" not in out:
        raise ConversionError("the head has a draft vocabulary (d2t) but no lm_head")
    if "d2t" in out and out["d2t"].size != out["output.weight"].shape[0]:
        raise ConversionError(f"d2t has {out['d2t'].size} ids and lm_head {out['output.weight'].shape[0]} rows")


def convert(head_dir: Path, target_path: Path, output: Path, outtype: str = "f16") -> Dict[str, Any]:
    """Write the head's GGUF; returns a summary (its sizes and what was assumed)."""
    import gguf  # noqa: WPS433

    config, layer = head_config(head_dir)
    target = Target(target_path)
    layers = target_layers(config, target)
    hidden_size = int(config.get("target_hidden_size") or layer.get("target_hidden_size") or target.hidden_size)
    out = gguf_tensors(head_tensors(head_dir), layer, target.n_vocab, outtype)
    check_head(out, layer, hidden_size, target)
    n_head = int(layer["num_attention_heads"])
    head_dim = int(layer.get("head_dim") or int(layer["hidden_size"]) // n_head)
    factors = rope_factors(layer, head_dim)
    if factors is not None:
        out["rope_freqs.weight"] = factors
    flags = {key: bool(config.get(key, layer.get(key, False))) for key in ("norm_before_residual", "norm_before_fc")}
    if flags["norm_before_fc"] and "enc.output_norm.weight" not in out:
        raise ConversionError("norm_before_fc is set, and the head has no input_norm")
    partial = output.with_name(f"{output.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), ARCH)
    try:
        writer.add_name(head_dir.name)
        _add_keys(writer, layer, n_head, head_dim, layers, hidden_size, flags, outtype)
        target.copy_tokenizer(writer)
        for name, value in out.items():
            raw = gguf.GGMLQuantizationType.I64 if name == "d2t" else None
            writer.add_tensor(name, value, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    return dict(target_layers=layers, target_hidden_size=hidden_size, n_vocab=target.n_vocab,
                n_draft_vocab=int(out["d2t"].size) if "d2t" in out else target.n_vocab,
                own_token_embd="token_embd.weight" in out, **flags)


def _add_keys(writer: Any, layer: Dict[str, Any], n_head: int, head_dim: int, layers: Sequence[int],
              hidden_size: int, flags: Dict[str, bool], outtype: str) -> None:
    import gguf  # noqa: WPS433

    rope_theta = float(layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    for key, value in (("context_length", int(layer.get("max_position_embeddings", 4096))),
                       ("embedding_length", int(layer["hidden_size"])), ("block_count", 1),
                       ("feed_forward_length", int(layer["intermediate_size"])),
                       ("attention.head_count", n_head),
                       ("attention.head_count_kv", int(layer.get("num_key_value_heads", n_head))),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("rope.dimension_count", head_dim), ("target_hidden_size", hidden_size)):
        writer.add_uint32(f"{ARCH}.{key}", value)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(layer.get("rms_norm_eps", 1e-6)))
    writer.add_float32(f"{ARCH}.rope.freq_base", rope_theta)
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in layers])
    for key, value in flags.items():
        writer.add_bool(f"{ARCH}.{key}", value)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write an EAGLE-3 head's GGUF (llama.cpp's eagle3 architecture) from "
        "its published config.json + safetensors and its target's GGUF (tokenizer and sizes).")
    parser.add_argument("head_dir", type=Path, help="folder of the head: config.json and *.safetensors")
    parser.add_argument("target", type=Path, help="the target model's GGUF")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the head's GGUF to write")
    parser.add_argument("--outtype", choices=("f16", "f32"), default="f16",
                        help="type of the weight matrices (norms stay F32, d2t I64); default f16")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 conversion or write failure, 2 usage)."""
    args = _parse_args(argv)
    try:
        summary = convert(args.head_dir, args.target, args.output, args.outtype)
    except (ConversionError, OSError) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    except KeyError as error:
        print(f"{PROG}: the head's config.json has no {error}", file=sys.stderr)
        return 1
    print(f"{PROG}: {args.output} ({args.output.stat().st_size} bytes): target layers "
          f"{summary['target_layers']}, features of size {summary['target_hidden_size']}, draft "
          f"vocabulary {summary['n_draft_vocab']} of {summary['n_vocab']}, norm_before_residual "
          f"{summary['norm_before_residual']}, norm_before_fc {summary['norm_before_fc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
