"""EAGLE-3 drafting for a Gemma 3 target: the features copied by llama.cpp's eval callback
(engine/llama/features.py), a head for the embedded Gemma 3 270M model, and the engine.

Gemma 3's llama.cpp graph exports no layer features; the engine installs an eval callback in the
target's context when ``draft.model_path`` names an EAGLE-3 head, and it copies the head's three
layer inputs from the graph while the head may draft. The head here is *fitted* to the F16 copy of
the embedded model's greedy text (test/support/gemma3_eagle3.py: SpecForge's layout, converted by
gemma-spec-eagle3-convert; made once and kept in the model cache, ~20 MB), so its drafts are partly
accepted. Tests marked ``exact`` compare tokens with ``off`` and need llama.cpp's exact build; under
the default build they skip here and test/engine/test_exact_build.py runs them under it.

The drafting is also replayed outside the engine (the features of the whole text captured in one
decode, the head's cache rebuilt from nothing at each pass): its tau equals the engine's, exactly
under the exact build.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, List, Tuple

import gguf
import numpy as np
import pytest

from gemma_spec_ros.engine.config import ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.drafters.eagle3 import Eagle3Bindings, Eagle3Drafter
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.llama.features import (CAPTURE_ARCHITECTURES, ExportedFeatures,
                                                  FeatureCapture, capture_of, eval_callback_for,
                                                  node_name)
from gemma_spec_ros.engine.llama.model import LlamaModel
from gemma_spec_ros.engine.llama.process import batch_invariant_build
from gemma_spec_ros.engine.modes import MODES
from gemma_spec_ros.engine.request import GenerationRequest, Step
from support import gemma3_eagle3
from support.engine import build_engine
from support.gemma3_eagle3 import capture, open_target, replay_tau, write_fitted_head
from support.tiny_eagle3 import write_eagle3_head, write_eagle3_pair
from support.tiny_gguf import write_tiny_gguf

N_CTX = 512
K = 3
#: the text the head is fitted to (the target's greedy continuation of it)
FIT_PROMPT = "The robot picks up the red cup and puts it on the table. Then it"
#: a related prompt: drafts accept 0 to K tokens (greedy, 48 tokens: tau ~2.0, measured)
REPLAY_PROMPT = "The robot picks up the blue box. Then it"
N_TOKENS = 48
PLAN_SCHEMA = json.dumps({
    "type": "object", "properties": {"action": {"enum": ["pick", "place", "wait"]},
                                     "object": {"type": "string", "maxLength": 12}},
    "required": ["action", "object"]})
#: the replayed tau may differ from the engine's by this much where multi-row passes give other
#: features than one decode of the text (the default build's sgemm); exact under the exact build
TAU_NOISE = 0.1


def cache_dir() -> Path:
    return Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")


@pytest.fixture(scope="session")
def fitted_head(f16_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fitted head of the F16 model, made once (~20-60 s: the fit, then the converter reading
    the target's 262,144-token tokenizer) and kept in the model cache under a name that changes
    with the code that writes it."""
    from gemma_spec_ros.tools import eagle3_convert
    from support import eagle3_layouts

    digest = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (
        gemma3_eagle3, eagle3_layouts, eagle3_convert))).hexdigest()[:12]
    path = cache_dir() / "models" / f"gemma-3-270m-f16-eagle3-fitted-{digest}.gguf"
    if not path.is_file():
        made, _ = write_fitted_head(tmp_path_factory.mktemp("gemma3-head"), f16_model_path, FIT_PROMPT,
                                    n_tokens=N_TOKENS + 16, n_threads=1)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(made.read_bytes())
        os.replace(partial, path)
    return path


def make_engine(target: Path, head: Path, **spec: object) -> Engine:
    """p_min 0 and a fixed K by default: every step drafts K tokens."""
    settings = dict(mode="eagle3", draft_max=K, p_min=0.0, adaptive=False)
    settings.update(spec)
    return build_engine(target, head, n_ctx=N_CTX, n_threads=1, spec=SpecConfig(**settings))


@pytest.fixture(scope="module")
def engine(f16_model_path: Path, fitted_head: Path) -> Iterator[Engine]:
    engine = make_engine(f16_model_path, fitted_head)
    yield engine
    engine.close()


def run(engine: Engine, mode: str, prompt: str = REPLAY_PROMPT, max_tokens: int = N_TOKENS,
        sampling: SamplingParams = SamplingParams(), **request: object) -> Tuple[List[int], List[Step]]:
    steps = list(engine.generate(GenerationRequest(prompt, max_tokens=max_tokens, spec_mode=mode,
                                                   sampling=sampling, **request)))
    return [t for s in steps for t in s.tokens], steps


# -- the capture -------------------------------------------------------------------------------------
def test_only_a_head_over_a_captured_architecture_gets_an_eval_callback(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """The callback is a context parameter: the engine asks for it before it loads the target, from
    the two GGUFs' headers. Without a head, or for a target that exports its features, none."""
    gemma4, gemma4_head = write_eagle3_pair(tmp_path)
    gemma3_head = write_eagle3_head(tmp_path / "for-gemma3.gguf", layers=(0, 2, 3))
    target = ModelConfig(str(embedded_model_path))
    assert CAPTURE_ARCHITECTURES == ("gemma3",)
    assert eval_callback_for(target, None) is None
    assert eval_callback_for(target, ModelConfig(str(embedded_model_path))) is None  # no head
    assert eval_callback_for(ModelConfig(str(gemma4)), ModelConfig(str(gemma4_head))) is None
    assert eval_callback_for(target, ModelConfig(str(tmp_path / "missing.gguf"))) is None
    callback = eval_callback_for(target, ModelConfig(str(gemma3_head)))
    assert isinstance(callback.capture, FeatureCapture) and not callback.capture.enabled
    plain = build_engine(embedded_model_path, n_ctx=N_CTX, n_threads=1, spec=SpecConfig(mode="auto"))
    try:
        assert plain.target.eval_callback is None and capture_of(plain.target) is None
    finally:
        plain.close()


def test_the_feature_nodes_are_layer_inputs() -> None:
    assert [node_name(i) for i in (0, 1, 2, 17)] == ["inp_scaled", "l_out-0", "l_out-1", "l_out-16"]


def test_captured_rows_are_the_scaled_embeddings_and_the_export_of_gemma4(tmp_path: Path) -> None:
    """Two checks of what the callback copies, row by row. Feature 0 of a gemma3 target is its
    token embedding x sqrt(n_embd), read here from the GGUF. On a gemma4 target, whose graph names
    the same nodes and also exports them, the copies equal llama.cpp's export bit for bit, for a
    multi-row prompt and a one-row pass."""
    gemma3 = write_tiny_gguf(tmp_path / "g3.gguf", vocab_size=256, n_embd=64, n_layer=4, arch="gemma3", seed=1)
    embd = next(np.array(t.data) for t in gguf.GGUFReader(str(gemma3)).tensors if t.name == "token_embd.weight")
    model = open_target(gemma3, n_threads=1)
    try:
        tokens = [2, 40, 41, 77, 200, 9, 9, 130]
        [scaled] = capture(model, tokens, (0,))
        np.testing.assert_allclose(scaled, embd[tokens] * np.sqrt(64), rtol=1e-6)
    finally:
        model.close()

    target, _ = write_eagle3_pair(tmp_path / "g4")
    capture_ = FeatureCapture()
    model = LlamaModel(ModelConfig(str(target), n_ctx=N_CTX, n_threads=1), eval_callback=capture_.function)
    try:
        capture_.want([0, 1, 1], 64, model.n_batch)  # a node read twice is copied once
        export = ExportedFeatures(model, [0, 1, 1], 2, 64, Eagle3Bindings())
        capture_.enable(True)
        export.enable(True)
        for part in ([2, 40, 41, 77, 200], [9]):
            model.decode(part, [len(part) - 1])
            copied, exported = capture_.rows(), export.rows()
            assert [c.shape for c in copied] == [(len(part), 64)] * 3
            for c, e in zip(copied, exported):
                assert np.array_equal(c, e[:len(part)])
        capture_.enable(False)
        model.decode([5, 6], [1])
        assert capture_.rows()[0].shape == (0, 64)  # nothing claimed while disabled
    finally:
        export.enable(False)
        model.close()


def test_features_do_not_depend_on_the_pass_shape(f16_model_path: Path) -> None:
    """The rows of a prompt decoded at once equal those of one-row passes: bit for bit under the
    exact build (batch-invariant), within the default build's multi-row rounding otherwise."""
    model = open_target(f16_model_path, n_threads=1)
    try:
        tokens = model.tokenize(FIT_PROMPT)[:12]
        whole = capture(model, tokens, gemma3_eagle3.LAYERS)
        features = capture_of(model)
        features.enable(True)
        model.clear()
        rows = []
        for token in tokens:
            model.decode([token], [0])
            rows.append([r.copy() for r in features.rows()])
        features.enable(False)
        for k, block in enumerate(whole):
            one_by_one = np.concatenate([r[k] for r in rows])
            if batch_invariant_build():
                assert np.array_equal(one_by_one, block)
            else:
                scale = np.abs(block).max()
                assert np.abs(one_by_one - block).max() <= 1e-3 * scale
    finally:
        model.close()


# -- the drafter on gemma3 ---------------------------------------------------------------------------
def test_the_head_drafts_for_the_gemma3_target(engine: Engine, fitted_head: Path) -> None:
    drafter = engine.drafters["eagle3"].drafter
    assert isinstance(drafter, Eagle3Drafter) and isinstance(drafter.features, FeatureCapture)
    assert engine.target.architecture == "gemma3"
    info = engine.model_info()["draft"]
    assert info["target_layers"] == list(gemma3_eagle3.LAYERS) and info["n_draft_vocab"] == gemma3_eagle3.N_DRAFT
    tokens, steps = run(engine, "eagle3")
    stats = steps[-1].stats
    assert len(tokens) == N_TOKENS and stats.num_drafts > 10
    assert stats.drafts_by_source == {"eagle3": stats.num_drafts}
    # fitted to a related text: some drafts wholly accepted, some not at all
    assert stats.acceptance_histogram[0] > 0 and stats.acceptance_histogram[K] > 0, stats.acceptance_histogram
    assert 1.3 < stats.mean_acceptance_length < 3.5


def test_the_capture_copies_only_while_the_head_may_draft(engine: Engine) -> None:
    capture_ = capture_of(engine.target)
    run(engine, "lookup", max_tokens=8)
    assert not capture_.enabled and not engine.target.chunk_listeners
    tokens, steps = run(engine, "eagle3", max_tokens=8)
    assert capture_.enabled and steps[-1].stats.num_drafts > 0
    assert engine.check_spec(SpecConfig(mode="auto")) == "" and "eagle3" in MODES["auto"].chain


def test_non_finite_features_stop_the_head_with_a_fault(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head whose fc is stored in F16 overflows on Gemma 3's features (up to ~1e5, above F16's
    65,504): llama.cpp multiplies in F16 and g turns infinite, then NaN through the head's cache.
    The drafter stops drafting and says why once (the output is the target's anyway)."""
    drafter = engine.drafters["eagle3"].drafter
    real_encode = drafter.head.encode

    def overflowing(features_at: int, n: int, out: np.ndarray) -> None:
        real_encode(features_at, n, out)
        out[0, 0] = np.inf

    monkeypatch.setattr(drafter.head, "encode", overflowing)
    reference, _ = run(engine, "off", max_tokens=16)
    tokens, steps = run(engine, "eagle3", max_tokens=16)
    assert tokens == reference or not batch_invariant_build()
    assert steps[-1].stats.num_drafts == 0
    faults = engine.take_faults()
    assert any("non-finite features" in f and "--outtype f32" in f for f in faults), faults
    monkeypatch.undo()
    drafter.before_target_pass(False)  # the module's engine drafts again, from fresh g rows
    drafter._unusable = ""


# -- output identical to plain decoding, and tau replayed outside the engine ---------------------------
@pytest.mark.exact
@pytest.mark.timeout(600)
def test_greedy_eagle3_on_gemma3_equals_off_token_for_token(exact_build, engine: Engine) -> None:
    for prompt in (REPLAY_PROMPT, FIT_PROMPT, "Write a list of three colors:"):
        reference, _ = run(engine, "off", prompt)
        for mode in ("eagle3", "auto"):
            tokens, steps = run(engine, mode, prompt)
            assert tokens == reference, (prompt, mode)
            assert steps[-1].stats.num_drafts > 0 or mode == "auto"


@pytest.mark.exact
@pytest.mark.timeout(600)
def test_seeded_sampling_eagle3_on_gemma3_equals_off(exact_build, engine: Engine) -> None:
    for seed in (3, 11):
        sampling = SamplingParams(temperature=0.8, top_k=40, seed=seed)
        reference, _ = run(engine, "off", sampling=sampling)
        tokens, steps = run(engine, "eagle3", sampling=sampling)
        assert tokens == reference, seed
        assert steps[-1].stats.num_drafts > 0


@pytest.mark.exact
@pytest.mark.timeout(600)
def test_constrained_eagle3_on_gemma3_equals_off(exact_build, engine: Engine) -> None:
    """A JSON schema and a grammar: rows a constraint decides alone are verified without logits,
    and the capture still copies every row's features."""
    prompt = "Plan the robot's next action as JSON:"
    for constraint in (dict(json_schema=PLAN_SCHEMA),
                       dict(grammar='root ::= "The robot picks up the " ("red" | "blue") " " [a-z]+ "."')):
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
            reference, _ = run(engine, "off", prompt, 40, sampling, **constraint)
            tokens, steps = run(engine, "eagle3", prompt, 40, sampling, **constraint)
            assert tokens == reference, (constraint, sampling)
            assert steps[-1].stats.num_drafts > 0


def engine_and_replayed_tau(engine: Engine, target: Path, head: Path) -> Tuple[float, float, List[int]]:
    """(engine's tau, replayed tau, the engine's acceptance histogram) of a greedy request."""
    tokens, steps = run(engine, "eagle3")
    stats = steps[-1].stats
    assert steps[-1].finish_reason == "length"
    prompt = engine.count_prompt(GenerationRequest(REPLAY_PROMPT, max_tokens=N_TOKENS)).tokens
    replayed, drafts, accepted = replay_tau(target, head, list(prompt) + tokens, len(prompt), K, n_threads=1)
    assert drafts == stats.num_drafts or not batch_invariant_build()
    return stats.mean_acceptance_length, replayed, list(stats.acceptance_histogram)


@pytest.mark.timeout(600)
def test_tau_replayed_from_the_head_offline_equals_the_engines(engine: Engine, f16_model_path: Path,
                                                               fitted_head: Path) -> None:
    ours, replayed, histogram = engine_and_replayed_tau(engine, f16_model_path, fitted_head)
    assert histogram[0] > 0 and histogram[K] > 0, histogram  # not all accepted, not all rejected
    assert abs(ours - replayed) <= TAU_NOISE, (ours, replayed)


@pytest.mark.exact
@pytest.mark.timeout(600)
def test_tau_replayed_offline_equals_the_engines_exactly(exact_build, engine: Engine, f16_model_path: Path,
                                                         fitted_head: Path) -> None:
    ours, replayed, _ = engine_and_replayed_tau(engine, f16_model_path, fitted_head)
    assert ours == replayed


# -- the profile ---------------------------------------------------------------------------------------
def test_the_gemma3_4b_profile_names_a_head_and_its_estimates(repo_root: Path) -> None:
    """config/gemma3_4b_eagle3.yaml read through the node's parameter mapping (which imports no
    ROS): an eagle3 profile for Gemma 3 4B, its figures marked estimated."""
    from gemma_spec_dev.bench import config as bench_config
    from gemma_spec_ros.node import parameters as node_parameters

    path = repo_root / "gemma_spec_ros" / "config" / "gemma3_4b_eagle3.yaml"
    profile = node_parameters.engine_config_from({**node_parameters.defaults(),
                                                  **bench_config.load_params(path)})
    assert profile.spec.mode == "eagle3" and profile.spec.adaptive and profile.target.flash_attn
    assert profile.target.path == "/opt/models/gemma-3-4b-it-Q4_K_M.gguf"
    assert profile.draft is not None and profile.draft.path == "/opt/models/gemma-3-4b-it-eagle3-F32.gguf"
    assert profile.draft.n_ctx == profile.target.n_ctx  # the head's cache holds the target's positions
    text = path.read_text()
    assert "estimated, not measured" in text and "--outtype f32" in text and "gemma-spec-export-traffic" in text
