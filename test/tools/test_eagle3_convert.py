"""gemma-spec-eagle3-convert: a head in the published formats (speculators, SpecForge) -> its GGUF.

The tiny random head of test/support/tiny_eagle3.py is written here the way trainers publish heads
(config.json + safetensors, Hugging Face tensor names and rotary layout, d2t as offsets, BF16 or
F32), converted with the tiny gemma4 target's GGUF, and compared tensor by tensor with the same head
written directly as a GGUF; the converted file then drafts in the engine's EAGLE-3 drafter.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Dict, Tuple

import gguf
import numpy as np
import pytest

from gemma_spec_ros.tools.eagle3_convert import PROG, main, rotary_rows_to_ggml
from support.tiny_eagle3 import RANDOM_HEAD_DIM, RANDOM_HEADS, TARGET_LAYERS, head_tensors, write_eagle3_head
from support.tiny_gemma4 import TARGET_EMBD, VOCAB_SIZE, write_gemma4_target

SEED = 2
#: GGUF layer names (after blk.0.) -> Hugging Face names (after the layer prefix)
HF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "attn_norm_2": "hidden_norm",
            "ffn_norm": "post_attention_layernorm"}
HF_HEAD = {"fc.weight": "fc.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
LAYER_CONFIG = dict(hidden_size=TARGET_EMBD, num_attention_heads=RANDOM_HEADS, num_key_value_heads=1,
                    head_dim=RANDOM_HEAD_DIM, intermediate_size=2 * TARGET_EMBD, rms_norm_eps=1e-6,
                    rope_theta=10000.0, max_position_embeddings=4096, num_hidden_layers=1,
                    hidden_act="silu", vocab_size=VOCAB_SIZE, model_type="llama")


def rotary_rows_to_hf(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of the converter's reordering: ggml's adjacent pairs -> HF's two halves."""
    half = weights.shape[0] // n_heads // 2
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def published_tensors(layer_prefix: str) -> Dict[str, np.ndarray]:
    """The tiny random head's tensors as a trainer saves them."""
    tensors, n_head, _ = head_tensors(False, SEED)
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
            out["t2d"] = np.zeros(VOCAB_SIZE, dtype=bool)
        else:
            out[HF_HEAD[name]] = value
    return out


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


def write_published_head(directory: Path, style: str, bf16: bool = False, **config_changes: object) -> Path:
    """The tiny random head in ``style`` ``speculators`` or ``specforge``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if style == "speculators":
        tensors = published_tensors("layers.0.")
        config = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
                      draft_vocab_size=int(tensors["d2t"].size), norm_before_residual=False,
                      norm_before_fc=False, target_hidden_size=None,
                      eagle_aux_hidden_state_layer_ids=list(TARGET_LAYERS),
                      transformer_layer_config=dict(LAYER_CONFIG))
    else:
        tensors = published_tensors("midlayer.")
        config = dict(LAYER_CONFIG, architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=int(tensors["d2t"].size),
                      eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(TARGET_LAYERS)))
    config.update(config_changes)
    (directory / "config.json").write_text(json.dumps(config))
    if bf16:
        write_safetensors_bf16(directory / "model.safetensors", tensors)
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def gguf_tensors(path: Path) -> Dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("eagle3-convert")
    return (write_gemma4_target(folder / "target.gguf"),
            write_eagle3_head(folder / "direct-head.gguf", seed=SEED))


@pytest.mark.parametrize("style", ["speculators", "specforge"])
def test_a_published_head_converts_to_the_same_tensors(pair: Tuple[Path, Path], tmp_path: Path,
                                                       style: str, capsys: pytest.CaptureFixture) -> None:
    target, direct = pair
    head_dir = write_published_head(tmp_path / style, style)
    output = tmp_path / "head.gguf"
    assert main([str(head_dir), str(target), "-o", str(output), "--outtype", "f32"]) == 0
    assert "target layers [0, 1, 2]" in capsys.readouterr().out
    converted, expected = gguf_tensors(output), gguf_tensors(direct)
    assert set(converted) == set(expected)  # t2d dropped
    for name, value in expected.items():
        assert np.array_equal(converted[name], value), name
    assert converted["d2t"].dtype == np.int64
    fields = gguf.GGUFReader(str(output)).fields
    assert list(fields["eagle3.target_layers"].contents()) == [0, 1, 2]
    assert fields["eagle3.target_hidden_size"].contents() == TARGET_EMBD
    assert fields["tokenizer.ggml.tokens"].contents() == gguf.GGUFReader(str(target)).fields[
        "tokenizer.ggml.tokens"].contents()


def test_a_bf16_head_converts_and_drafts(pair: Tuple[Path, Path], tmp_path: Path) -> None:
    """BF16 weights (what published heads carry), F16 out: the converted head loads in the drafter
    and drafts what the direct F32 head drafts, within the two roundings."""
    from gemma_spec_ros.engine.llama.model import LlamaModel
    from gemma_spec_ros.engine.drafters.eagle3 import Eagle3Drafter
    from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig

    target, direct = pair
    output = tmp_path / "head-f16.gguf"
    assert main([str(write_published_head(tmp_path / "bf16", "speculators", bf16=True)), str(target),
                 "-o", str(output)]) == 0
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(output)).tensors}
    assert types["fc.weight"] == types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    backend = LlamaModel(ModelConfig(str(target), n_ctx=256, n_threads=1))
    try:
        prompt = backend.tokenize("the robot picks up the red cup. ")
        distributions = []
        for head in (direct, output):
            drafter = Eagle3Drafter(ModelConfig(str(head), n_ctx=256, n_threads=1), backend)
            try:
                backend.clear()
                drafter.before_target_pass(True)
                backend.decode(prompt, [len(prompt) - 1])
                drafter.begin(prompt, SamplingParams(temperature=1.0), np.random.default_rng(1))
                draft = drafter.propose(prompt + [40], 3, SpecConfig(p_min=0.0))
                distributions.append(draft.probs)
            finally:
                drafter.close()
    finally:
        backend.close()
    for q_direct, q_converted in zip(*distributions):
        np.testing.assert_allclose(q_converted, q_direct, atol=0.02)


def test_the_worked_examples_run() -> None:
    import doctest

    from gemma_spec_ros.tools import eagle3_convert

    assert doctest.testmod(eagle3_convert).failed == 0


def test_the_rotary_reordering_pairs_the_two_halves() -> None:
    rows = np.arange(16, dtype=np.float32).reshape(16, 1)
    ggml = rotary_rows_to_ggml(rows, 2)
    assert ggml.ravel().tolist()[:8] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert np.array_equal(rotary_rows_to_hf(ggml, 2), rows)


@pytest.mark.parametrize("changes, message", [
    (dict(eagle_aux_hidden_state_layer_ids=[0, 1, 9]), r"target layers \[0, 1, 9\].*2 \(ids 0..2\)"),
    (dict(transformer_layer_config=dict(LAYER_CONFIG, num_hidden_layers=2)), "one decoder layer"),
    (dict(transformer_layer_config=dict(LAYER_CONFIG, hidden_size=32)), "hidden size 32 is not the target's 64"),
    (dict(transformer_layer_config=dict(LAYER_CONFIG, hidden_act="gelu")), "activation 'gelu'"),
    (dict(target_hidden_size=128), "features of size 128, the target has 64"),
    (dict(speculators_model_type="medusa"), "no EAGLE-3 head"),
])
def test_what_cannot_make_a_head_is_refused(pair: Tuple[Path, Path], tmp_path: Path, changes: dict,
                                            message: str, capsys: pytest.CaptureFixture) -> None:
    head_dir = write_published_head(tmp_path / "bad", "speculators", **changes)
    output = tmp_path / "head.gguf"
    assert main([str(head_dir), str(pair[0]), "-o", str(output)]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"{PROG}: ") and re.search(message, error), error
    assert not output.exists() and not list(tmp_path.glob("*.partial"))


def test_a_d2t_outside_the_target_vocabulary_is_refused(pair: Tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    from safetensors.numpy import load_file, save_file

    head_dir = write_published_head(tmp_path / "d2t", "specforge")
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 100  # absolute ids past 255
    save_file(tensors, str(head_dir / "model.safetensors"))
    assert main([str(head_dir), str(pair[0]), "-o", str(tmp_path / "h.gguf")]) == 1
    assert "outside the target's vocabulary of 256" in capsys.readouterr().err


def test_an_unknown_tensor_is_refused(pair: Tuple[Path, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    from safetensors.numpy import load_file, save_file

    head_dir = write_published_head(tmp_path / "bias", "speculators")
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors["layers.0.self_attn.q_proj.bias"] = np.zeros(64, dtype=np.float32)
    save_file(tensors, str(head_dir / "model.safetensors"))
    assert main([str(head_dir), str(pair[0]), "-o", str(tmp_path / "h.gguf")]) == 1
    assert "'layers.0.self_attn.q_proj.bias'" in capsys.readouterr().err
