"""``gemma-spec-eagle3-convert``: an EAGLE-3 head as trained -> the head's GGUF for llama.cpp.

    gemma-spec-eagle3-convert HEAD_DIR TARGET.gguf -o head.gguf [--outtype f16|f32]

``HEAD_DIR`` holds the head's ``config.json`` and ``*.safetensors`` in one of three layouts, told
apart by config.json and checked against the tensor names:

- **native**, what llama.cpp's own ``convert_hf_to_gguf.py`` reads (and the project's trainer
  writes): a flat Llama config with ``architectures`` ``LlamaForCausalLMEagle3`` (or
  ``Eagle3LlamaForCausalLM`` / ``Eagle3DraftModel`` / ``Eagle3Speculator``) and
  ``draft_vocab_size``, the target layers in a top-level ``eagle_aux_hidden_state_layer_ids``;
- **speculators** (vllm-project/speculators, served by vLLM): ``"speculators_model_type":
  "eagle3"``, the decoder layer's config nested under ``transformer_layer_config``, the verifier
  (target) named under ``speculators_config.verifier``, the layers in a top-level
  ``eagle_aux_hidden_state_layer_ids``; tensors ``layers.0.*``, ``embed_tokens`` usually saved;
- **specforge** (sgl-project/SpecForge, served by SGLang): a flat ``LlamaForCausalLMEagle3`` config
  with SpecForge's own keys (``eagle_config``, ``target_model_type``, ``fc_norm``,
  ``norm_output``), the layers in ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors
  ``midlayer.*``, no ``embed_tokens`` from its SGLang export (the head borrows the target's).

**Which target features.** The GGUF's ``eagle3.target_layers`` use llama.cpp's numbering: id i < n
(n = the target's block count) is the input of target layer i (0: the embeddings), id n the final
post-norm state. The layouts number them their own way:

- native: llama.cpp's numbering, ids 0..n;
- speculators: vLLM's numbering, the same for i < n; vLLM's id n is the last layer's output
  *before* the final norm, which llama.cpp does not export, so ids 0..n-1;
- specforge: SGLang's numbering, id i = the *output* of layer i, which SGLang captures as the input
  of layer i + 1: the ids + 1, so 0..n-2 as written;
- none given: every trainer's default, the inputs of layers [2, n // 2, n - 3] (SpecForge writes
  the same layers as [1, n // 2 - 1, n - 4]).

``TARGET.gguf`` is the GGUF of the model the head drafts for: its tokenizer keys are copied into
the head (llama.cpp loads a vocabulary with every model), its sizes give the defaults above and the
checks (the layers the head reads exist in it; the head's widths and draft vocabulary fit it).
llama.cpp's own converter needs the target's Hugging Face files instead, which are gated for Gemma.

What changes on the way (the file format llama.cpp 0c1e57098 reads, ``eagle3`` architecture):

- tensor names: ``self_attn.{q,k,v,o}_proj`` -> ``blk.0.attn_{q,k,v,output}``,
  ``mlp.{gate,up,down}_proj`` -> ``blk.0.ffn_*``, ``input_layernorm`` -> ``attn_norm``,
  ``hidden_norm`` -> ``attn_norm_2``, ``post_attention_layernorm`` -> ``ffn_norm``, ``norm`` ->
  ``output_norm``, ``lm_head`` -> ``output``, ``embed_tokens`` -> ``token_embd``, ``input_norm``
  -> ``enc.output_norm`` (``norm_before_fc``); ``t2d`` and speculators' training-only
  ``verifier_lm_head`` / ``verifier_norm`` are dropped;
- Q and K rows are reordered per head from the Hugging Face rotary layout (each head's rotated
  dimensions as two halves) to ggml's (adjacent pairs), as for every Llama-family conversion;
- ``d2t`` is stored by trainers as offsets (draft id i -> target id i + d2t[i]) and by llama.cpp as
  absolute target ids (I64), checked in range and without duplicates;
- BF16 weights (numpy has no bfloat16) are widened to F32 before ``--outtype``.

What llama.cpp's eagle3 graph cannot run is refused with the reason, not converted into a head that
drafts wrongly: EAGLE 3.1's per-feature ``fc_norm``, speculators' ``norm_output`` (the normed state
fed back between steps), SpecForge's ``norm_output: false``, Qwen3-style Q/K norms, biases, an FFN
other than SiLU's (speculators gives the head its verifier's activation unless told otherwise:
Gemma's is GELU), more than one decoder layer. So is a malformed file: the exit status is 1 and
stderr has one line saying why. A sliding window (speculators' default for new heads) is not
refused but noted: llama.cpp's eagle3 graph attends to the whole context, which is the same while
the context fits the window.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

PROG = "gemma-spec-eagle3-convert"
ARCH = "eagle3"
NATIVE, SPECULATORS, SPECFORGE = "native", "speculators", "specforge"
#: ``architectures`` of flat EAGLE-3 configs (the names llama.cpp's converter registers; EAGLE's and
#: SpecForge's ``LlamaForCausalLMEagle3``, vLLM's ``Eagle3LlamaForCausalLM``); speculators' configs
#: are told by their own key.
FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel",
                      "Eagle3Speculator")
#: keys only SpecForge's draft configs have (``configs/*-eagle3*.json``; ``use_aux_norm`` is the older
#: name of ``fc_norm`` that SGLang's loader still reads)
SPECFORGE_KEYS = ("eagle_config", "target_model_type", "fc_norm", "norm_output", "use_aux_norm")
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
#: HF names of the decoder layer's tensors (after its prefix) -> GGUF names (after ``blk.0.``)
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
#: prefixes of the one decoder layer: SpecForge's and EAGLE's ``midlayer.``, speculators'
#: ``layers.0.``, and ``model.layers.0.`` (what llama.cpp's converter renames both to)
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
#: HF names of the head's own tensors (an optional ``model.`` before them) -> GGUF names (None:
#: not used by llama.cpp, dropped): ``t2d`` is the inverse of ``d2t``; ``verifier_*`` are the
#: target's norm and output head that speculators keeps for its training loss
HEAD_TENSORS: Dict[str, Optional[str]] = {
    "fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight", "input_norm.weight": "enc.output_norm.weight",
    "d2t": "d2t", "t2d": None, "verifier_lm_head.weight": None, "verifier_norm.weight": None,
}
#: every tensor llama.cpp's eagle3 loader requires (``d2t``, ``output``, ``token_embd`` and
#: ``enc.output_norm`` are optional or depend on a flag)
REQUIRED_TENSORS = ("fc.weight", "output_norm.weight") + tuple(
    "blk.0." + name for name in LAYER_TENSORS.values())
#: safetensors dtypes the ``safetensors`` package hands to numpy as they are (BF16 is widened here)
NUMPY_DTYPES = ("F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
_REQUIRED = object()
_KINDS = {"count": "a positive integer", "number": "a positive number", "flag": "true or false",
          "object": "a JSON object", "text": "a string"}


class ConversionError(ValueError):
    """The head directory or the target cannot make a head's GGUF (the message says why)."""


# -- config.json ----------------------------------------------------------------------------------------
def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(section: Mapping[str, Any], key: str, kind: str, where: str, default: Any = _REQUIRED) -> Any:
    """``section[key]`` if it is of ``kind`` (see ``_KINDS``); ``default`` if absent or null (how
    Hugging Face configs write an unset value), a ConversionError naming the field otherwise."""
    value = section.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConversionError(f"{where} has no {key}")
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    valid = {"count": number and isinstance(value, int) and 0 < value < 2 ** 32,  # GGUF's uint32
             "number": number and (isinstance(value, int) or math.isfinite(value)) and value > 0,
             "flag": isinstance(value, bool), "object": isinstance(value, dict),
             "text": isinstance(value, str)}[kind]
    if not valid:
        raise ConversionError(f"{where}: {key} is {_shown(value)}, expected {_KINDS[kind]}")
    return value


@dataclass(frozen=True)
class LayerIds:
    """The target layers as a head's config names them, and how to read that numbering."""

    given: Tuple[int, ...]
    field: str  #: where in config.json
    numbering: str  #: whose numbering, in words
    shift: int  #: added to each id to make llama.cpp's (layer inputs)
    final_state: bool  #: whether id n (llama.cpp's final post-norm state) is one the trainer saw

    def ids(self) -> List[int]:
        """The ids in llama.cpp's numbering.

        >>> LayerIds((1, 13, 25), "eagle_config", "SGLang's", 1, False).ids()
        [2, 14, 26]
        """
        return [layer + self.shift for layer in self.given]


@dataclass(frozen=True)
class HeadConfig:
    """What the conversion reads of a head's config.json, checked and in one form for every layout."""

    layout: str
    source: Path
    hidden_size: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    n_ctx_train: int
    target_hidden_size: Optional[int]
    draft_vocab_size: Optional[int]
    layer_ids: Optional[LayerIds]
    norm_before_residual: bool
    norm_before_fc: bool
    verifier: Optional[str]
    sliding_window: Optional[int]  #: the window the head was trained with (None: the whole context)


def _layout(config: Dict[str, Any], where: str) -> str:
    """Which layout a config.json is in (see the module docstring)."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ConversionError(f"{where} is no EAGLE-3 head: its speculators_model_type is {_shown(kind)}")
        return SPECULATORS
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(name, str) for name in architectures)):
        raise ConversionError(f"{where}: architectures is {_shown(architectures)}, expected a list of strings")
    if not set(architectures or ()) & set(FLAT_ARCHITECTURES) or "draft_vocab_size" not in config:
        raise ConversionError(f"{where} is no EAGLE-3 head: expected speculators_model_type 'eagle3', "
                              f"or architectures {'/'.join(FLAT_ARCHITECTURES)} with draft_vocab_size")
    return SPECFORGE if any(key in config for key in SPECFORGE_KEYS) else NATIVE


def _id_list(value: Any, field: str, where: str) -> Tuple[int, ...]:
    if not (isinstance(value, list) and len(value) == 3
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ConversionError(f"{where}: {field} is {_shown(value)}, expected a list of 3 integers "
                              "(the target layers an EAGLE-3 head reads)")
    return tuple(value)


def _layer_ids(config: Dict[str, Any], layout: str, where: str) -> Optional[LayerIds]:
    """The head's target layers as its config names them (None: the trainers' default)."""
    eagle_config = _field(config, "eagle_config", "object", where, {})
    top, nested = config.get(IDS_KEY), eagle_config.get(IDS_KEY)
    if layout == SPECULATORS:
        # speculators' Eagle3SpeculatorConfig names them eagle_aux_hidden_state_layer_ids (what vLLM
        # reads); its DFlash-family configs say aux_hidden_state_layer_ids, which loaders of
        # speculators checkpoints also accept for EAGLE-3: read as a second spelling.
        field = IDS_KEY if top is not None else "aux_hidden_state_layer_ids"
        value = config.get(field)
        if value is None:
            return None
        return LayerIds(_id_list(value, field, where), field,
                        "vLLM's numbering: id i = the input of target layer i", 0, False)
    from_top = None if top is None else LayerIds(
        _id_list(top, IDS_KEY, where), IDS_KEY,
        "llama.cpp's numbering: id i < n = the input of target layer i, id n = its final state", 0, True)
    # SpecForge's eagle_config ids are what its trainer and SGLang capture: SGLang's
    # set_eagle3_layers_to_capture adds one to each (id i: "the output of layer i"), and SpecForge's
    # own default [1, n // 2 - 1, n - 4] is SGLang's [2, n // 2, n - 3]. (vLLM, falling back to
    # eagle_config when a config has no top-level ids, reads them without adding one.)
    from_nested = None if nested is None else LayerIds(
        _id_list(nested, f"eagle_config.{IDS_KEY}", where), f"eagle_config.{IDS_KEY}",
        "SGLang's numbering: id i = the output of target layer i = the input of layer i + 1", 1, False)
    if from_top and from_nested and from_top.ids() != from_nested.ids():
        raise ConversionError(f"{where}: {IDS_KEY} {list(from_top.given)} (layer inputs) and "
                              f"eagle_config.{IDS_KEY} {list(from_nested.given)} (layer outputs, the "
                              f"inputs {from_nested.ids()}) name different target layers")
    return from_top or from_nested


def _rope(layer: Dict[str, Any], where: str) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope theta, rope scaling or None) from ``rope_theta``/``rope_scaling`` or transformers
    5's ``rope_parameters``."""
    scaling = _field(layer, "rope_scaling", "object", where, None)
    parameters = _field(layer, "rope_parameters", "object", where, None) or {}
    if any(isinstance(value, dict) for value in parameters.values()):
        raise ConversionError(f"{where}: rope_parameters per attention type ({', '.join(parameters)}); "
                              "llama.cpp's eagle3 graph has one rope")
    theta = _field(layer, "rope_theta", "number", where, None) or \
        _field(parameters, "rope_theta", "number", f"{where} rope_parameters", 10000.0)
    return float(theta), scaling or (parameters or None)


def _flag(sections: Sequence[Tuple[Dict[str, Any], str]], key: str, default: bool) -> bool:
    """A boolean key from the first of ``sections`` (mapping, where) that has it."""
    for section, where in sections:
        value = _field(section, key, "flag", where, None)
        if value is not None:
            return bool(value)
    return default


def read_config(directory: Path) -> HeadConfig:
    """``directory/config.json`` of any layout, checked (a ConversionError names what is wrong)."""
    path = directory / "config.json"
    where = str(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds a JSON {type(config).__name__}, expected an object")
    layout = _layout(config, where)
    layer, layer_where = config, where
    verifier = None
    if layout == SPECULATORS:
        layer_where = f"{where} transformer_layer_config"
        layer = _field(config, "transformer_layer_config", "object", where)
        speculators = _field(config, "speculators_config", "object", where, {})
        algorithm = _field(speculators, "algorithm", "text", f"{where} speculators_config", "eagle3")
        if algorithm != "eagle3":
            raise ConversionError(f"{where} is no EAGLE-3 head: its speculators_config.algorithm is {algorithm!r}")
        verifier_config = _field(speculators, "verifier", "object", f"{where} speculators_config", {})
        verifier = _field(verifier_config, "name_or_path", "text", f"{where} speculators_config.verifier", None)
    sections = [(config, where), (layer, layer_where)] if layer is not config else [(config, where)]
    if _field(layer, "num_hidden_layers", "count", layer_where, 1) != 1:
        raise ConversionError(f"{layer_where}: num_hidden_layers {layer['num_hidden_layers']}; an EAGLE-3 "
                              "head has one decoder layer")
    activation = _field(layer, "hidden_act", "text", layer_where, None) or \
        _field(layer, "hidden_activation", "text", layer_where, "silu")
    if activation != "silu":
        raise ConversionError(f"{layer_where}: activation {activation!r}; llama.cpp's eagle3 graph runs "
                              "a SiLU-gated FFN")
    layer_types = layer.get("layer_types")
    sliding = _flag(sections, "use_sliding_window", False) or (
        isinstance(layer_types, list) and layer_types[:1] == ["sliding_attention"])
    sliding_window = _field(layer, "sliding_window", "count", layer_where, None) if sliding else None
    if sliding and sliding_window is None:
        raise ConversionError(f"{layer_where}: sliding-window attention without a sliding_window size")
    _refuse_unsupported_norms(sections, layout, where)
    hidden_size = _field(layer, "hidden_size", "count", layer_where)
    n_head = _field(layer, "num_attention_heads", "count", layer_where)
    head_dim = _field(layer, "head_dim", "count", layer_where, None)
    if head_dim is None:
        if hidden_size % n_head:
            raise ConversionError(f"{layer_where}: no head_dim, and hidden_size {hidden_size} is no "
                                  f"multiple of num_attention_heads {n_head}")
        head_dim = hidden_size // n_head
    if head_dim % 2:
        raise ConversionError(f"{layer_where}: head_dim {head_dim} is odd; rope rotates pairs")
    n_head_kv = _field(layer, "num_key_value_heads", "count", layer_where, n_head)
    if n_head % n_head_kv:
        raise ConversionError(f"{layer_where}: num_attention_heads {n_head} is no multiple of "
                              f"num_key_value_heads {n_head_kv}")
    rope_theta, rope_scaling = _rope(layer, layer_where)
    return HeadConfig(
        layout=layout, source=path, hidden_size=hidden_size, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=_field(layer, "intermediate_size", "count", layer_where),
        rms_eps=float(_field(layer, "rms_norm_eps", "number", layer_where, 1e-6)),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        n_ctx_train=_field(layer, "max_position_embeddings", "count", layer_where, 4096),
        target_hidden_size=_field(config, "target_hidden_size", "count", where, None)
        or _field(layer, "target_hidden_size", "count", layer_where, None),
        draft_vocab_size=_field(config, "draft_vocab_size", "count", where, None),
        layer_ids=_layer_ids(config, layout, where),
        # absent: speculators heads are served by vLLM, which then sets it (its speculators config
        # adapter defaults norm_before_residual to true); llama.cpp's converter defaults to false
        norm_before_residual=_flag(sections, "norm_before_residual", layout == SPECULATORS),
        norm_before_fc=_flag(sections, "norm_before_fc", False), verifier=verifier,
        sliding_window=sliding_window)


def _refuse_unsupported_norms(sections: Sequence[Tuple[Dict[str, Any], str]], layout: str, where: str) -> None:
    """EAGLE 3.1's norms that llama.cpp's eagle3 graph does not have."""
    for key in ("fc_norm", "use_aux_norm"):  # speculators' and SpecForge's name, SpecForge's older one
        if _flag(sections, key, False):
            raise ConversionError(f"{where}: {key} is set: one RMSNorm per target feature before fc "
                                  "(EAGLE 3.1); llama.cpp's eagle3 graph has one norm over the three "
                                  "together (norm_before_fc)")
    if layout == SPECULATORS and _flag(sections, "norm_output", False):
        raise ConversionError(f"{where}: norm_output is set (speculators' default for EAGLE-3 since "
                              "EAGLE 3.1): the head feeds its normed state back between drafting steps; "
                              "llama.cpp's eagle3 graph feeds back the state before the final norm "
                              "(train with norm_output false)")
    if layout != SPECULATORS and not _flag(sections, "norm_output", True):
        raise ConversionError(f"{where}: norm_output is false: the head's output layer reads its state "
                              "without the final norm; llama.cpp's eagle3 graph always applies it")


# -- the safetensors files -------------------------------------------------------------------------
def read_safetensors(path: Path) -> Dict[str, np.ndarray]:
    """Every tensor of a safetensors file, by name. Its 8-byte header size is checked against the
    file's size first, then the ``safetensors`` package validates the header (JSON, dtypes, shapes,
    data offsets within the file) before anything is read; F32/F16/integer/bool tensors come through
    its numpy API, BF16 (which numpy lacks) from the file's own layout (an 8-byte little-endian
    header size, a JSON header of dtype, shape and data offsets, the data), widened to F32 by
    putting its 16 bits above 16 zero bits."""
    from safetensors import SafetensorError, safe_open  # noqa: WPS433  a tool's dependency, not the node's

    size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
    if len(prefix) < 8:
        raise ConversionError(f"{path}: {size} bytes, too short for a safetensors file (it starts "
                              "with an 8-byte header size)")
    (header_size,) = struct.unpack("<Q", prefix)
    if header_size > size - 8:
        raise ConversionError(f"{path}: its header size field says {header_size} bytes, the file has "
                              f"{size - 8} after it: no safetensors file, or a truncated one")
    try:
        with safe_open(str(path), framework="np") as tensors:
            names = list(tensors.keys())
            with open(path, "rb") as fh:
                fh.seek(8)
                header = json.loads(fh.read(header_size))
            out = {}
            for name in names:
                out[name] = _read_tensor(path, tensors, name, header[name], 8 + header_size)
            return out
    except SafetensorError as error:
        raise ConversionError(f"{path}: not a valid safetensors file: {error}") from None


def _read_tensor(path: Path, tensors: Any, name: str, info: Dict[str, Any], start: int) -> np.ndarray:
    dtype = info["dtype"]
    if dtype in NUMPY_DTYPES:
        return tensors.get_tensor(name)
    if dtype != "BF16":
        raise ConversionError(f"{path}: tensor {name!r} is {dtype}; this converter reads F32, F16, "
                              "BF16 and integer tensors (dequantize the head first)")
    begin, end = info["data_offsets"]
    with open(path, "rb") as fh:
        fh.seek(start + begin)
        raw = np.frombuffer(fh.read(end - begin), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def head_tensors(directory: Path) -> Dict[str, np.ndarray]:
    """Every tensor of the head's safetensors files, by HF name."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(path.name for path in directory.glob("*.bin")) if directory.is_dir() else []
        hint = f" ({', '.join(others)}: PyTorch pickles are not read; save the head as safetensors)" if others else ""
        raise ConversionError(f"no *.safetensors in {directory}{hint}")
    tensors: Dict[str, np.ndarray] = {}
    for path in files:
        for name, value in read_safetensors(path).items():
            if name in tensors:
                raise ConversionError(f"tensor {name!r} is in two of the head's files")
            tensors[name] = value
    return tensors


# -- the target ---------------------------------------------------------------------------------------
class Target:
    """What the conversion needs of the target's GGUF: its sizes and its tokenizer keys."""

    def __init__(self, path: Path) -> None:
        import gguf  # noqa: WPS433

        try:
            fields = gguf.GGUFReader(str(path)).fields
            self.architecture = str(self._value(fields, "general.architecture"))
            self.hidden_size = int(self._value(fields, f"{self.architecture}.embedding_length"))
            self.n_layer = int(self._value(fields, f"{self.architecture}.block_count"))
            self.tokenizer = {name: field for name, field in fields.items() if name.startswith("tokenizer.")}
            if "tokenizer.ggml.tokens" not in self.tokenizer:
                raise ConversionError(f"the target {path} has no tokenizer.ggml.tokens")
            self.n_vocab = len(self.tokenizer["tokenizer.ggml.tokens"].contents())
        except ConversionError:
            raise
        except (OSError, ValueError, TypeError, IndexError, KeyError, struct.error) as error:
            raise ConversionError(f"cannot read the target {path}: {error}") from None

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


def target_layers(head: HeadConfig, target: Target) -> List[int]:
    """The head's target layers in llama.cpp's numbering (see the module docstring), checked
    against the target's layer count n: ids 0..n where the head's numbering has llama.cpp's final
    state, 0..n-1 (layer inputs) where the trainer's id n would be another feature."""
    n = target.n_layer
    if head.layer_ids is None:
        layers = [2, n // 2, n - 3]
        if min(layers) < 0 or max(layers) >= n:
            raise ConversionError(f"{head.source} names no target layers, and the trainers' default, "
                                  f"layers [2, n / 2, n - 3] = {layers}, does not fit a {n}-layer target "
                                  f"(layer inputs 0..{n - 1}): name them in {IDS_KEY}")
        return layers
    named, layers = head.layer_ids, head.layer_ids.ids()
    top = n if named.final_state else n - 1
    if min(layers) >= 0 and max(layers) <= top:
        return layers
    shifted = "" if named.shift == 0 else f", the inputs of layers {layers}"
    reach = (f"ids 0..{n} (0..{n - 1}: layer inputs, {n}: its final post-norm state)" if named.final_state
             else f"layer inputs 0..{n - 1}")
    why = ("; llama.cpp exports the last layer's output only after the final norm, which the trainer "
           "did not see" if not named.final_state and max(layers) == n else "")
    raise ConversionError(f"target layers {list(named.given)} ({named.field} in {named.numbering}"
                          f"{shifted}): the target has {n} layers, {reach}{why}")


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


def rope_factors(scaling: Optional[Dict[str, Any]], rope_theta: float, head_dim: int,
                 where: str = "config.json") -> Optional[np.ndarray]:
    """llama3 rope scaling as per-dimension frequency divisors (llama.cpp's ``rope_freqs``); None
    without scaling. The llama3 rule: wavelengths shorter than the original context / high factor
    keep their frequency, longer than original / low factor are divided by ``factor``, and those in
    between are blended linearly in original / wavelength.

    >>> scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    >>> [round(float(f), 2) for f in rope_factors(scaling, 10000.0, 8)]
    [1.0, 7.67, 8.0, 8.0]
    """
    scaling = scaling or {}
    where = f"{where} rope scaling"
    kind = str(_field(scaling, "rope_type", "text", where, None) or _field(scaling, "type", "text", where, "default"))
    if kind.lower() == "default":
        return None
    if kind.lower() != "llama3":
        raise ConversionError(f"rope scaling {kind!r}: this converter knows llama3 scaling only")
    base = float(_field(scaling, "rope_theta", "number", where, rope_theta))
    factor = float(_field(scaling, "factor", "number", where, 8.0))
    low = float(_field(scaling, "low_freq_factor", "number", where, 1.0))
    high = float(_field(scaling, "high_freq_factor", "number", where, 4.0))
    original = float(_field(scaling, "original_max_position_embeddings", "number", where, 8192))
    if high <= low:
        raise ConversionError(f"{where}: high_freq_factor {high} is not above low_freq_factor {low}")
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


def gguf_names(tensors: Dict[str, np.ndarray]) -> Dict[str, Tuple[str, np.ndarray]]:
    """The head's tensors by llama.cpp's name: ``{gguf name: (HF name, array)}``; dropped ones left
    out, and what llama.cpp's eagle3 graph has no place for refused."""
    out: Dict[str, Tuple[str, np.ndarray]] = {}
    prefixes = sorted({p for name in tensors for p in LAYER_PREFIXES if name.startswith(p)})
    if len(prefixes) > 1:
        raise ConversionError(f"decoder layer tensors under both {' and '.join(prefixes)}: one layer, "
                              "one prefix")
    for name, value in tensors.items():
        prefix = next((p for p in LAYER_PREFIXES if name.startswith(p)), None)
        short = name[len(prefix):] if prefix else name[len("model."):] if name.startswith("model.") else name
        if prefix is not None and short in LAYER_TENSORS:
            gguf_name: Optional[str] = "blk.0." + LAYER_TENSORS[short]
        elif prefix is None and short in HEAD_TENSORS:
            gguf_name = HEAD_TENSORS[short]
        else:
            raise ConversionError(f"tensor {name!r}: {_no_place(short)}")
        if gguf_name in out:
            raise ConversionError(f"tensors {out[gguf_name][0]!r} and {name!r} are both the head's {gguf_name}")
        if gguf_name is not None:
            out[gguf_name] = (name, value)
    return out


def _no_place(short: str) -> str:
    """Why llama.cpp's eagle3 graph has no place for a tensor (its name after the layer prefix)."""
    if short.endswith(".bias"):
        return "biases are not supported by llama.cpp's eagle3 graph"
    if short in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        return "Q/K norms (a Qwen3-style decoder layer) are not in llama.cpp's eagle3 graph"
    if short.startswith("fc_norm."):
        return "per-feature norms before fc (EAGLE 3.1 fc_norm) are not in llama.cpp's eagle3 graph"
    if short.startswith(("layers.", "midlayer")):
        return "a second decoder layer; llama.cpp's eagle3 graph runs one"
    return "none an EAGLE-3 head has"


def check_head(out: Dict[str, Tuple[str, np.ndarray]], head: HeadConfig, target_hidden: int,
               target: Target) -> None:
    """Refuse a head llama.cpp would not load, or would load and then could not run for this
    target: missing tensors, shapes that do not fit the config, sizes that do not fit the target."""
    missing = [name for name in REQUIRED_TENSORS if name not in out]
    if head.norm_before_fc and "enc.output_norm.weight" not in out:
        missing.append("enc.output_norm.weight (input_norm, for norm_before_fc)")
    if missing:
        raise ConversionError(f"the head has no {', '.join(missing)}")
    if head.hidden_size != target.hidden_size:
        raise ConversionError(f"the head's hidden size {head.hidden_size} is not the target's "
                              f"{target.hidden_size}: it borrows the target's embeddings (a head of "
                              "another model?)")
    if target_hidden != target.hidden_size:
        raise ConversionError(f"the head reads target features of size {target_hidden}, the target has "
                              f"{target.hidden_size}")
    d2t = out.get("d2t", (None, None))[1]
    if d2t is not None and (d2t.ndim != 1 or not np.issubdtype(d2t.dtype, np.integer)):
        raise ConversionError(f"d2t is {d2t.dtype} of shape {list(d2t.shape)}, expected a vector of "
                              "integer offsets")
    if d2t is not None and "output.weight" not in out:
        raise ConversionError("the head has a draft vocabulary (d2t) but no lm_head")
    n_draft = d2t.size if d2t is not None else target.n_vocab
    if head.draft_vocab_size is not None and d2t is not None and head.draft_vocab_size != n_draft:
        raise ConversionError(f"config.json's draft_vocab_size {head.draft_vocab_size} is not the "
                              f"{n_draft} ids of d2t")
    for name, shape in _expected_shapes(head, target_hidden, n_draft, target.n_vocab).items():
        if name in out and tuple(out[name][1].shape) != shape:
            hf_name, value = out[name]
            detail = (" (d2t's draft vocabulary)" if name == "output.weight" and d2t is not None else
                      " (the target's vocabulary: the head has no d2t)" if name == "output.weight" else "")
            raise ConversionError(f"tensor {hf_name!r} has shape {list(value.shape)}, expected "
                                  f"{list(shape)}{detail} from config.json and the target")


def _expected_shapes(head: HeadConfig, target_hidden: int, n_draft: int, n_vocab: int) -> Dict[str, Tuple[int, ...]]:
    """The (rows, columns) each tensor must have, in numpy's order (ggml's reversed)."""
    hidden, q_rows, kv_rows = head.hidden_size, head.n_head * head.head_dim, head.n_head_kv * head.head_dim
    shapes = {"fc.weight": (hidden, 3 * target_hidden), "enc.output_norm.weight": (3 * target_hidden,),
              "output_norm.weight": (hidden,), "output.weight": (n_draft, hidden),
              "token_embd.weight": (n_vocab, hidden)}
    layer = {"attn_q": (q_rows, 2 * hidden), "attn_k": (kv_rows, 2 * hidden), "attn_v": (kv_rows, 2 * hidden),
             "attn_output": (hidden, q_rows), "ffn_gate": (head.n_ff, hidden), "ffn_up": (head.n_ff, hidden),
             "ffn_down": (hidden, head.n_ff), "attn_norm": (hidden,), "attn_norm_2": (hidden,),
             "ffn_norm": (hidden,)}
    shapes.update({f"blk.0.{name}.weight": shape for name, shape in layer.items()})
    return shapes


def gguf_arrays(out: Dict[str, Tuple[str, np.ndarray]], head: HeadConfig, n_vocab: int,
                outtype: str) -> Dict[str, np.ndarray]:
    """The checked tensors as llama.cpp stores them (see the module docstring)."""
    float_type = np.float16 if outtype == "f16" else np.float32
    arrays: Dict[str, np.ndarray] = {}
    for name, (_, value) in out.items():
        if name == "d2t":
            arrays[name] = absolute_d2t(value, n_vocab)
            continue
        if name == "blk.0.attn_q.weight":
            value = rotary_rows_to_ggml(value, head.n_head)
        elif name == "blk.0.attn_k.weight":
            value = rotary_rows_to_ggml(value, head.n_head_kv)
        # norms (1-D) stay F32, as llama.cpp's converters keep them
        arrays[name] = np.ascontiguousarray(value, dtype=float_type if value.ndim > 1 else np.float32)
    return arrays


def convert(head_dir: Path, target_path: Path, output: Path, outtype: str = "f16") -> Dict[str, Any]:
    """Write the head's GGUF; returns a summary (its sizes and what was assumed)."""
    import gguf  # noqa: WPS433

    if not output.parent.is_dir():
        raise ConversionError(f"cannot write {output}: no folder {output.parent}")
    head = read_config(head_dir)
    target = Target(target_path)
    layers = target_layers(head, target)
    target_hidden = head.target_hidden_size or target.hidden_size
    named = gguf_names(head_tensors(head_dir))
    check_head(named, head, target_hidden, target)
    out = gguf_arrays(named, head, target.n_vocab, outtype)
    factors = rope_factors(head.rope_scaling, head.rope_theta, head.head_dim, str(head.source))
    if factors is not None:
        out["rope_freqs.weight"] = factors
    flags = {"norm_before_residual": head.norm_before_residual, "norm_before_fc": head.norm_before_fc}
    partial = output.with_name(f"{output.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), ARCH)
    try:
        writer.add_name(head_dir.name)
        _add_keys(writer, head, layers, target_hidden, flags, outtype)
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
    named_ids = head.layer_ids
    return dict(layout=head.layout, target_layers=layers,
                layers_from=named_ids.field if named_ids else "the trainers' default",
                layers_given=list(named_ids.given) if named_ids else None,
                target_hidden_size=target_hidden, n_vocab=target.n_vocab,
                n_draft_vocab=int(out["d2t"].size) if "d2t" in out else target.n_vocab,
                own_token_embd="token_embd.weight" in out, verifier=head.verifier,
                sliding_window=head.sliding_window, **flags)


def _add_keys(writer: Any, head: HeadConfig, layers: Sequence[int], target_hidden: int,
              flags: Dict[str, bool], outtype: str) -> None:
    import gguf  # noqa: WPS433

    for key, value in (("context_length", head.n_ctx_train), ("embedding_length", head.hidden_size),
                       ("block_count", 1), ("feed_forward_length", head.n_ff),
                       ("attention.head_count", head.n_head), ("attention.head_count_kv", head.n_head_kv),
                       ("attention.key_length", head.head_dim), ("attention.value_length", head.head_dim),
                       ("rope.dimension_count", head.head_dim), ("target_hidden_size", target_hidden)):
        writer.add_uint32(f"{ARCH}.{key}", value)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", head.rms_eps)
    writer.add_float32(f"{ARCH}.rope.freq_base", head.rope_theta)
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in layers])
    for key, value in flags.items():
        writer.add_bool(f"{ARCH}.{key}", value)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write an EAGLE-3 head's GGUF (llama.cpp's eagle3 architecture) from "
        "its config.json + safetensors (llama.cpp's own layout, vllm-project/speculators' or "
        "SpecForge's) and its target's GGUF (tokenizer, sizes and layer count).")
    parser.add_argument("head_dir", type=Path, help="folder of the head: config.json and *.safetensors")
    parser.add_argument("target", type=Path, help="the target model's GGUF")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the head's GGUF to write")
    parser.add_argument("--outtype", choices=("f16", "f32"), default="f16",
                        help="type of the weight matrices (norms stay F32, d2t I64); default f16")
    return parser.parse_args(argv)


def _malformed_input_errors() -> Tuple[type, ...]:
    """What reading a malformed head or target can raise past the checks (a safety net: the
    message names the exception's type)."""
    errors: Tuple[type, ...] = (ValueError, TypeError, KeyError, IndexError, AttributeError,
                                struct.error, MemoryError, OverflowError)
    try:
        from safetensors import SafetensorError  # noqa: WPS433
    except ImportError:  # without the package, head_tensors fails with ImportError: not caught
        return errors
    return errors + (SafetensorError,)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 conversion or write failure, 2 usage). A
    failure is one line on stderr, never a traceback, and leaves no output file."""
    args = _parse_args(argv)
    try:
        summary = convert(args.head_dir, args.target, args.output, args.outtype)
    except (ConversionError, OSError) as error:
        return _fail(str(error))
    except _malformed_input_errors() as error:
        return _fail(f"cannot convert {args.head_dir}: {type(error).__name__}: {error}")
    given = summary["layers_given"]
    layers_from = summary["layers_from"] + (f" {given}" if given is not None and given != summary[
        "target_layers"] else "")
    verifier = f" (verifier {summary['verifier']})" if summary["verifier"] else ""
    print(f"{PROG}: {args.output} ({args.output.stat().st_size} bytes) from a {summary['layout']} "
          f"head{verifier}: target layers {summary['target_layers']} ({layers_from}), features of size "
          f"{summary['target_hidden_size']}, draft vocabulary {summary['n_draft_vocab']} of "
          f"{summary['n_vocab']}, norm_before_residual {summary['norm_before_residual']}, "
          f"norm_before_fc {summary['norm_before_fc']}")
    window = summary["sliding_window"]
    if window is not None:  # not refused: the same drafts while the context fits the window
        print(f"{PROG}: note: the head was trained with a sliding window of {window} tokens, which "
              f"llama.cpp's eagle3 graph does not apply: it drafts as trained while the context is "
              f"within {window} tokens, and attends to more beyond", file=sys.stderr)
    return 0


def _fail(reason: str) -> int:
    print(f"{PROG}: {' '.join(reason.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
