"""gemma-spec-eagle3-convert: a head as its trainer writes it (llama.cpp's own layout, speculators,
SpecForge) -> its GGUF.

The tiny random head of test/support/tiny_eagle3.py is written the way each trainer saves heads
(test/support/eagle3_layouts.py: config.json + safetensors, Hugging Face tensor names and rotary
layout, d2t as offsets, BF16 or F32) and converted: in llama.cpp's layout for the tiny gemma4 target
and compared tensor by tensor with the same head written directly as a GGUF (the converted file then
drafts in the engine's EAGLE-3 drafter); in the trainers' layouts for a 12-layer target header and
compared with converting the llama.cpp layout of the same weights. Heads llama.cpp cannot run, and
malformed files, fail with exit status 1 and one line on stderr.
"""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import gguf
import numpy as np
import pytest

from gemma_spec_ros.tools.eagle3_convert import PROG, main, rotary_rows_to_ggml
from support.eagle3_layouts import (LAYER_CONFIG, direct_tensors, rotary_rows_to_hf, write_head,
                                    write_target_header)
from support.tiny_eagle3 import write_eagle3_head
from support.tiny_gemma4 import TARGET_EMBD, write_gemma4_target

SEED = 2
DEEP_LAYERS = 12  # the target header's layer count: the trainers' default layers are [2, 6, 9]


def gguf_tensors(path: Path) -> Dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def eagle3_keys(path: Path) -> Dict[str, object]:
    fields = gguf.GGUFReader(str(path)).fields
    return {name: field.contents() for name, field in fields.items() if name.startswith("eagle3.")}


def convert(head_dir: Path, target: Path, output: Path, *options: str) -> int:
    return main([str(head_dir), str(target), "-o", str(output), *options])


def assert_refused(code: int, tmp_path: Path, output: Path, err: str, message: str) -> None:
    """Exit status 1, one line on stderr that says why, no traceback, no file left behind."""
    assert code == 1, err
    assert err.startswith(f"{PROG}: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not output.exists() and not list(tmp_path.rglob("*.partial"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("eagle3-convert")
    return (write_gemma4_target(folder / "target.gguf"),
            write_eagle3_head(folder / "direct-head.gguf", seed=SEED))


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_target_header(tmp_path_factory.mktemp("eagle3-deep") / "target-12.gguf", DEEP_LAYERS)


# -- llama.cpp's own layout, against the head written directly ------------------------------------------
@pytest.mark.parametrize("layer_prefix, head_prefix", [("midlayer.", ""), ("layers.0.", ""),
                                                       ("model.layers.0.", "model.")])
def test_a_native_head_converts_to_the_direct_heads_tensors(pair: Tuple[Path, Path], tmp_path: Path,
                                                            layer_prefix: str, head_prefix: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    target, direct = pair
    head_dir = write_head(tmp_path / "native", "native", layer_prefix=layer_prefix, head_prefix=head_prefix)
    output = tmp_path / "head.gguf"
    assert convert(head_dir, target, output, "--outtype", "f32") == 0
    assert "native head: target layers [0, 1, 2]" in capsys.readouterr().out
    converted, expected = gguf_tensors(output), gguf_tensors(direct)
    assert set(converted) == set(expected)  # t2d dropped
    for name, value in expected.items():
        assert np.array_equal(converted[name], value), name
    assert converted["d2t"].dtype == np.int64
    keys = eagle3_keys(output)
    assert keys.pop("eagle3.norm_before_fc") is False  # the direct head leaves it out: false
    assert keys == eagle3_keys(direct)  # target layers [0, 1, 2]: id 2, the final state
    assert gguf.GGUFReader(str(output)).fields["tokenizer.ggml.tokens"].contents() == \
        gguf.GGUFReader(str(target)).fields["tokenizer.ggml.tokens"].contents()


def test_a_bf16_head_converts_and_drafts(pair: Tuple[Path, Path], tmp_path: Path) -> None:
    """BF16 weights (what trainers save), F16 out: the converted head loads in the drafter and
    drafts what the direct F32 head drafts, within the two roundings."""
    from gemma_spec_ros.engine.llama.model import LlamaModel
    from gemma_spec_ros.engine.drafters.eagle3 import Eagle3Drafter
    from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig

    target, direct = pair
    output = tmp_path / "head-f16.gguf"
    assert convert(write_head(tmp_path / "bf16", "native", bf16=True), target, output) == 0
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


# -- the trainers' layouts, against llama.cpp's layout of the same weights -------------------------------
@pytest.mark.parametrize("layout, layers, bf16", [
    ("speculators", [3, 6, 9], False), ("specforge", [3, 6, 9], False),  # SpecForge writes [2, 5, 8]
    ("speculators", [0, 6, 11], True), ("specforge", [1, 6, 11], True),  # the ends each numbering reaches
    ("speculators", None, False), ("specforge", None, False),  # the default, [2, 6, 9]
])
def test_a_trainers_head_converts_to_what_its_native_layout_gives(
        deep_target: Path, tmp_path: Path, layout: str, layers: Optional[Sequence[int]], bf16: bool,
        capsys: pytest.CaptureFixture) -> None:
    """The same weights and target layers: the same GGUF tensors, values and eagle3 keys."""
    embed = layout == "speculators"
    native_out, trainer_out = tmp_path / "native.gguf", tmp_path / f"{layout}.gguf"
    assert convert(write_head(tmp_path / "native", "native", layers, bf16=bf16, embed=embed),
                   deep_target, native_out, "--outtype", "f32") == 0
    trainer_dir = write_head(tmp_path / layout, layout, layers, bf16=bf16)
    capsys.readouterr()
    assert convert(trainer_dir, deep_target, trainer_out, "--outtype", "f32") == 0
    expected_layers = list(layers) if layers else [2, DEEP_LAYERS // 2, DEEP_LAYERS - 3]
    verifier = " (verifier tiny/gemma4-target)" if layout == "speculators" else ""
    assert f"{layout} head{verifier}: target layers {expected_layers}" in capsys.readouterr().out
    native, trainer = gguf_tensors(native_out), gguf_tensors(trainer_out)
    assert set(trainer) == set(native) == set(direct_tensors(SEED, embed))
    for name, value in native.items():
        assert trainer[name].dtype == value.dtype and np.array_equal(trainer[name], value), name
    keys = eagle3_keys(trainer_out)
    assert keys == eagle3_keys(native_out)
    assert list(keys["eagle3.target_layers"]) == expected_layers


def test_specforge_ids_name_layer_outputs(deep_target: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    """SpecForge's [2, 5, 8] (outputs of layers 2, 5, 8, SGLang's numbering) are llama.cpp's
    [3, 6, 9] (inputs of layers 3, 6, 9)."""
    head_dir = write_head(tmp_path / "sf", "specforge", [3, 6, 9])
    config = json.loads((head_dir / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 8]
    assert convert(head_dir, deep_target, tmp_path / "h.gguf") == 0
    assert "(eagle_config.eagle_aux_hidden_state_layer_ids [2, 5, 8])" in capsys.readouterr().out
    assert list(eagle3_keys(tmp_path / "h.gguf")["eagle3.target_layers"]) == [3, 6, 9]


@pytest.mark.parametrize("layout, expected", [("speculators", True), ("native", False), ("specforge", False)])
def test_an_absent_norm_before_residual_is_read_as_the_trainers_runtime_does(
        deep_target: Path, tmp_path: Path, layout: str, expected: bool) -> None:
    """Left out of config.json: vLLM reads a speculators head as norm_before_residual true; llama.cpp's
    converter reads false, which is what SpecForge's layer does (it adds the un-normed features back)."""
    head_dir = write_head(tmp_path / layout, layout, [3, 6, 9])
    config = json.loads((head_dir / "config.json").read_text())
    config.pop("norm_before_residual", None)
    (head_dir / "config.json").write_text(json.dumps(config))
    assert convert(head_dir, deep_target, tmp_path / "h.gguf") == 0
    assert eagle3_keys(tmp_path / "h.gguf")["eagle3.norm_before_residual"] is expected


def test_a_sliding_window_is_noted_not_refused(deep_target: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    """speculators' new heads attend to a window of 2,048 tokens; llama.cpp's eagle3 graph to the
    whole context: the same head, noted on stderr."""
    layer = dict(LAYER_CONFIG, layer_types=["sliding_attention"], sliding_window=2048, use_sliding_window=True)
    head_dir = write_head(tmp_path / "swa", "speculators", [3, 6, 9], transformer_layer_config=layer)
    assert convert(head_dir, deep_target, tmp_path / "swa.gguf", "--outtype", "f32") == 0
    note = capsys.readouterr().err
    assert re.fullmatch(f"{PROG}: note: the head was trained with a sliding window of 2048 tokens, .*\n", note)
    assert convert(write_head(tmp_path / "full", "speculators", [3, 6, 9]), deep_target, tmp_path / "full.gguf",
                   "--outtype", "f32") == 0
    assert capsys.readouterr().err == ""
    swa, full = gguf_tensors(tmp_path / "swa.gguf"), gguf_tensors(tmp_path / "full.gguf")
    assert all(np.array_equal(swa[name], value) for name, value in full.items()) and set(swa) == set(full)


def test_speculators_verifier_only_tensors_are_dropped(deep_target: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    head_dir = write_head(tmp_path / "spec", "speculators", [3, 6, 9])
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors.update({"verifier_lm_head.weight": np.zeros((256, TARGET_EMBD), np.float32),
                    "verifier_norm.weight": np.ones(TARGET_EMBD, np.float32)})
    save_file(tensors, str(head_dir / "model.safetensors"))
    assert convert(head_dir, deep_target, tmp_path / "h.gguf") == 0
    assert not {"verifier_lm_head.weight", "verifier_norm.weight"} & set(gguf_tensors(tmp_path / "h.gguf"))


# -- which target layers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout, layers, message", [
    # vLLM's id 12 is the last layer's output before the final norm; llama.cpp exports it normed
    ("speculators", [3, 6, 12], r"target layers \[3, 6, 12\] \(eagle_aux_hidden_state_layer_ids in vLLM's "
                                r"numbering.*the target has 12 layers, layer inputs 0\.\.11; llama\.cpp "
                                r"exports the last layer's output only after the final norm"),
    ("speculators", [3, 6, 40], r"target layers \[3, 6, 40\].*the target has 12 layers, layer inputs 0\.\.11$"),
    ("specforge", [3, 6, 12], r"target layers \[2, 5, 11\] \(eagle_config\.eagle_aux_hidden_state_layer_ids "
                              r"in SGLang's numbering.*the inputs of layers \[3, 6, 12\]\): the target has 12"),
    ("native", [3, 6, 13], r"target layers \[3, 6, 13\].*the target has 12 layers, ids 0\.\.12 \(0\.\.11: "
                           r"layer inputs, 12: its final post-norm state\)"),
    ("native", [-1, 6, 9], r"target layers \[-1, 6, 9\]"),
])
def test_a_layer_the_target_cannot_give_is_refused(deep_target: Path, tmp_path: Path, layout: str,
                                                   layers: Sequence[int], message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "h.gguf"
    code = convert(write_head(tmp_path / layout, layout, layers), deep_target, output)
    assert_refused(code, tmp_path, output, capsys.readouterr().err, message)


def test_llama_cpps_layout_may_name_the_final_state(deep_target: Path, tmp_path: Path) -> None:
    assert convert(write_head(tmp_path / "native", "native", [3, 6, 12]), deep_target, tmp_path / "h.gguf") == 0
    assert list(eagle3_keys(tmp_path / "h.gguf")["eagle3.target_layers"]) == [3, 6, 12]


@pytest.mark.parametrize("layout", ["native", "speculators", "specforge"])
def test_no_layers_and_a_target_too_shallow_for_the_default_is_refused(
        pair: Tuple[Path, Path], tmp_path: Path, layout: str, capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "h.gguf"
    code = convert(write_head(tmp_path / layout, layout, None), pair[0], output)
    assert_refused(code, tmp_path, output, capsys.readouterr().err,
                   r"names no target layers, and the trainers' default, layers \[2, n / 2, n - 3\] = "
                   r"\[2, 1, -1\], does not fit a 2-layer target \(layer inputs 0\.\.1\)")


def test_two_numberings_that_disagree_are_refused(deep_target: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "h.gguf"
    head_dir = write_head(tmp_path / "sf", "specforge", [3, 6, 9], eagle_aux_hidden_state_layer_ids=[2, 5, 8])
    assert_refused(convert(head_dir, deep_target, output), tmp_path, output, capsys.readouterr().err,
                   r"eagle_aux_hidden_state_layer_ids \[2, 5, 8\] \(layer inputs\) and eagle_config\."
                   r"eagle_aux_hidden_state_layer_ids \[2, 5, 8\] \(layer outputs, the inputs \[3, 6, 9\]\)")
    head_dir = write_head(tmp_path / "agree", "specforge", [3, 6, 9], eagle_aux_hidden_state_layer_ids=[3, 6, 9])
    assert convert(head_dir, deep_target, tmp_path / "agree.gguf") == 0


# -- what llama.cpp's eagle3 graph cannot run ------------------------------------------------------------
@pytest.mark.parametrize("layout, changes, message", [
    ("speculators", dict(transformer_layer_config=dict(LAYER_CONFIG, num_hidden_layers=2)), "one decoder layer"),
    ("native", dict(hidden_size=32), "hidden size 32 is not the target's 64"),
    ("speculators", dict(transformer_layer_config=dict(LAYER_CONFIG, hidden_act="gelu")), "activation 'gelu'"),
    ("native", dict(target_hidden_size=128), "features of size 128, the target has 64"),
    ("speculators", dict(speculators_model_type="medusa"), "no EAGLE-3 head"),
    ("native", dict(architectures=["LlamaForCausalLM"]), "no EAGLE-3 head"),
    ("speculators", dict(fc_norm=True), "fc_norm is set: one RMSNorm per target feature"),
    ("specforge", dict(fc_norm=True), "fc_norm is set: one RMSNorm per target feature"),
    ("specforge", dict(use_aux_norm=True), "use_aux_norm is set"),
    ("speculators", dict(norm_output=True), r"norm_output is set \(speculators' default for EAGLE-3 since "
                                            r"EAGLE 3\.1\): the head feeds its normed state back"),
    ("specforge", dict(norm_output=False), "norm_output is false"),
    ("speculators", dict(speculators_config=dict(algorithm="dflash")), "speculators_config.algorithm is 'dflash'"),
    ("speculators", dict(transformer_layer_config=dict(LAYER_CONFIG, layer_types=["sliding_attention"])),
     "sliding-window attention without a sliding_window size"),
    ("native", dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope scaling 'yarn'"),
    ("native", dict(norm_before_fc=True), r"no enc\.output_norm\.weight \(input_norm, for norm_before_fc\)"),
    ("native", dict(draft_vocab_size=100), "draft_vocab_size 100 is not the 217 ids of d2t"),
    ("native", dict(num_attention_heads=4), r"'midlayer\.self_attn\.q_proj\.weight' has shape \[64, 128\], "
                                            r"expected \[128, 128\]"),
])
def test_what_cannot_make_a_head_is_refused(pair: Tuple[Path, Path], tmp_path: Path, layout: str, changes: dict,
                                            message: str, capsys: pytest.CaptureFixture) -> None:
    # target layers each numbering can name of 2 layers (SpecForge's written as [0, 0, 0])
    layers = {"native": (0, 1, 2), "speculators": (0, 1, 1), "specforge": (1, 1, 1)}[layout]
    output = tmp_path / "head.gguf"
    code = convert(write_head(tmp_path / "bad", layout, layers, **changes), pair[0], output)
    assert_refused(code, tmp_path, output, capsys.readouterr().err, message)


def _renamed(old: str, new: str) -> Callable[[Dict[str, np.ndarray]], None]:
    def edit(tensors: Dict[str, np.ndarray]) -> None:
        tensors[new] = tensors.pop(old)
    return edit


@pytest.mark.parametrize("layout, edit, message", [
    ("speculators", lambda t: t.update({"layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
     r"'layers\.0\.self_attn\.q_proj\.bias': biases are not supported"),
    ("speculators", lambda t: t.update({"layers.0.self_attn.q_norm.weight": np.ones(32, np.float32)}),
     r"Q/K norms \(a Qwen3-style decoder layer\)"),
    ("specforge", lambda t: t.update({f"fc_norm.{i}.weight": np.ones(64, np.float32) for i in range(3)}),
     r"'fc_norm\.0\.weight': per-feature norms before fc"),
    ("speculators", lambda t: t.update({"layers.1.mlp.up_proj.weight": np.ones((128, 64), np.float32)}),
     "a second decoder layer"),
    ("specforge", _renamed("midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight"),
     "decoder layer tensors under both layers.0. and midlayer."),
    ("specforge", lambda t: t.pop("midlayer.hidden_norm.weight"), r"the head has no blk\.0\.attn_norm_2\.weight"),
    ("specforge", lambda t: t.update({"model.fc.weight": t["fc.weight"]}),
     r"tensors '(model\.)?fc\.weight' and '(model\.)?fc\.weight' are both the head's fc\.weight"),
    ("specforge", lambda t: t.update({"d2t": t["d2t"] + 100}), "outside the target's vocabulary of 256"),
    ("specforge", lambda t: t.update({"d2t": t["d2t"].astype(np.float32)}), "d2t is float32"),
    ("specforge", lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}),
     r"'lm_head\.weight' has shape \[216, 64\], expected \[217, 64\] \(d2t's draft vocabulary\)"),
    ("speculators", lambda t: t.update({"embed_tokens.weight": t["embed_tokens.weight"][:, :32]}),
     r"'embed_tokens\.weight' has shape \[256, 32\], expected \[256, 64\]"),
    ("specforge", lambda t: t.update({"midlayer.mlp.experts.weight": np.ones(4, np.float32)}),
     r"'midlayer\.mlp\.experts\.weight': none an EAGLE-3 head has"),
])
def test_a_tensor_llama_cpp_has_no_place_for_is_refused(deep_target: Path, tmp_path: Path, layout: str,
                                                        edit: Callable[[Dict[str, np.ndarray]], None],
                                                        message: str, capsys: pytest.CaptureFixture) -> None:
    from safetensors.numpy import load_file, save_file

    head_dir = write_head(tmp_path / layout, layout, [3, 6, 9])
    tensors = load_file(str(head_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(head_dir / "model.safetensors"))
    output = tmp_path / "h.gguf"
    assert_refused(convert(head_dir, deep_target, output), tmp_path, output, capsys.readouterr().err, message)


# -- malformed files: one line, exit 1, no output ------------------------------------------------------
def _safetensors(data: bytes) -> Callable[[Path], None]:
    def edit(head_dir: Path) -> None:
        (head_dir / "model.safetensors").write_bytes(data)
    return edit


def _config(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(head_dir: Path) -> None:
        path = head_dir / "config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))
    return edit


def _header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


MALFORMED: Dict[str, Tuple[Callable[[Path], None], str]] = {
    # the reliability review's Q9 cases (each ended in a traceback before)
    "a 4-byte file": (_safetensors(b"\x01\x02\x03\x04"), r"model\.safetensors: 4 bytes, too short for a safetensors"),
    "a header that is no JSON": (_safetensors(struct.pack("<Q", 8) + b"notjson!"),
                                 r"model\.safetensors: not a valid safetensors file: .*header"),
    "a header size of 2**40": (_safetensors(struct.pack("<Q", 2 ** 40) + b"{}"),
                               r"header size field says 1099511627776 bytes, the file has 2 after it"),
    "a header size of 2**63-1": (_safetensors(struct.pack("<Q", 2 ** 63 - 1) + b"{}"),
                                 r"header size field says 9223372036854775807 bytes"),
    "tensor offsets past the file": (
        _safetensors(_header({"fc.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}, bytes(16))),
        r"not a valid safetensors file: .*not fully covered"),
    "target layers 'x'": (_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids="x")),
                          r"eagle_aux_hidden_state_layer_ids is 'x', expected a list of 3 integers"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2, 3]"),
                           r"config\.json holds a JSON list, expected an object"),
    # more of the same kinds
    "target layers [0, 1, true]": (_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, True])),
                                   r"eagle_aux_hidden_state_layer_ids is \[0, 1, true\], expected a list of 3"),
    "two target layers": (_config(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1])),
                          r"is \[0, 1\], expected a list of 3 integers"),
    "a head count as text": (_config(lambda c: c.update(num_attention_heads="2")),
                             r"config\.json: num_attention_heads is '2', expected a positive integer"),
    "no hidden size": (_config(lambda c: c.pop("hidden_size")), r"config\.json has no hidden_size"),
    "a zero FFN": (_config(lambda c: c.update(intermediate_size=0)), r"intermediate_size is 0, expected a positive"),
    "a context past uint32": (_config(lambda c: c.update(max_position_embeddings=2 ** 40)),
                              r"max_position_embeddings is 1099511627776, expected a positive integer"),
    "KV heads that divide no heads": (_config(lambda c: c.update(num_key_value_heads=3)),
                                      r"num_attention_heads 2 is no multiple of num_key_value_heads 3"),
    "an odd head size": (_config(lambda c: c.update(head_dim=33)), r"head_dim 33 is odd"),
    "an eps of NaN": (_config(lambda c: c.update(rms_norm_eps=float("nan"))),
                      r"rms_norm_eps is NaN, expected a positive number"),
    "a flag as text": (_config(lambda c: c.update(norm_before_residual="yes")),
                       r"norm_before_residual is 'yes', expected true or false"),
    "a rope scaling list": (_config(lambda c: c.update(rope_scaling=[8.0])),
                            r"rope_scaling is \[8\.0\], expected a JSON object"),
    "a rope factor as text": (_config(lambda c: c.update(rope_scaling=dict(rope_type="llama3", factor="8"))),
                              r"rope scaling: factor is '8', expected a positive number"),
    "an eagle_config list": (_config(lambda c: c.update(eagle_config=[1])),
                             r"eagle_config is \[1\], expected a JSON object"),
    "architectures as text": (_config(lambda c: c.update(architectures="LlamaForCausalLMEagle3")),
                              r"architectures is 'LlamaForCausalLMEagle3', expected a list of strings"),
    "config.json no JSON": (lambda d: (d / "config.json").write_text("{"), r"cannot read .*config\.json"),
    "no config.json": (lambda d: (d / "config.json").unlink(), r"cannot read .*config\.json"),
    "no safetensors": (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
                       r"no \*\.safetensors in .* \(pytorch_model\.bin: PyTorch pickles are not read"),
    "an FP8 tensor": (_safetensors(_header({"fc.weight": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}},
                                           bytes(4))), r"tensor 'fc\.weight' is F8_E4M3"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_head_fails_in_one_line(pair: Tuple[Path, Path], tmp_path: Path, case: str,
                                            capsys: pytest.CaptureFixture) -> None:
    edit, message = MALFORMED[case]
    head_dir = write_head(tmp_path / "head", "native")
    edit(head_dir)
    output = tmp_path / "head.gguf"
    assert_refused(convert(head_dir, pair[0], output), tmp_path, output, capsys.readouterr().err, message)


@pytest.mark.parametrize("case, message", [
    ("speculators_config", r"speculators_config is 'x', expected a JSON object"),
    ("transformer_layer_config", r"transformer_layer_config is 'x', expected a JSON object"),
])
def test_a_malformed_speculators_config_fails_in_one_line(pair: Tuple[Path, Path], tmp_path: Path, case: str,
                                                          message: str, capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "head.gguf"
    head_dir = write_head(tmp_path / "head", "speculators", (0, 1, 1), **{case: "x"})
    assert_refused(convert(head_dir, pair[0], output), tmp_path, output, capsys.readouterr().err, message)


def test_a_target_that_is_no_gguf_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF" + bytes(12))
    output = tmp_path / "head.gguf"
    code = convert(write_head(tmp_path / "head", "native"), target, output)
    assert_refused(code, tmp_path, output, capsys.readouterr().err, r"cannot read the target .*target\.gguf")


@pytest.mark.parametrize("error", [TypeError("unhashable"), struct.error("bad pack"), KeyError("dtype"),
                                   MemoryError()])
def test_an_error_past_the_checks_is_still_one_line(tmp_path: Path, error: BaseException,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    """The safety net under the checks: an exception no check foresaw is named in one line."""
    from gemma_spec_ros.tools import eagle3_convert

    def fail(*args: object) -> None:
        raise error

    monkeypatch.setattr(eagle3_convert, "convert", fail)
    output = tmp_path / "head.gguf"
    code = main([str(tmp_path / "head"), str(tmp_path / "target.gguf"), "-o", str(output)])
    assert_refused(code, tmp_path, output, capsys.readouterr().err,
                   f"cannot convert .*head: {type(error).__name__}")


def test_the_command_fails_without_a_traceback(pair: Tuple[Path, Path], tmp_path: Path) -> None:
    """The console script's process: exit status 1, one line on stderr, no traceback."""
    head_dir = write_head(tmp_path / "head", "native")
    MALFORMED["a header size of 2**63-1"][0](head_dir)
    output = tmp_path / "head.gguf"
    done = subprocess.run([sys.executable, "-m", "gemma_spec_ros.tools.eagle3_convert", str(head_dir),
                           str(pair[0]), "-o", str(output)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not output.exists() and not list(tmp_path.glob("*.partial"))


# -- the arithmetic -------------------------------------------------------------------------------------
def test_the_worked_examples_run() -> None:
    import doctest

    from gemma_spec_ros.tools import eagle3_convert

    assert doctest.testmod(eagle3_convert).failed == 0


def test_the_rotary_reordering_pairs_the_two_halves() -> None:
    rows = np.arange(16, dtype=np.float32).reshape(16, 1)
    ggml = rotary_rows_to_ggml(rows, 2)
    assert ggml.ravel().tolist()[:8] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert np.array_equal(rotary_rows_to_hf(ggml, 2), rows)
