"""The suffix drafter through the real Engine (spec modes ``suffix`` and ``suffix+lookup``): lossless
output against plain decoding under the exact build with the F16 copy (greedy, seeded sampling,
under the plan schema, at fixed K and with drafts cut by the policy), drafts from the history of
earlier requests, only the suffix policy learning from constrained drafts, its time in the step's draft
time, and its history file saved at close and loaded by the next engine.

The tests marked ``exact`` run in test/engine/test_exact_build.py's child under the exact build; the
prompt-reuse parity of the suffix mode is in test/engine/test_prompt_reuse.py.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Iterator, List

import jsonschema
import pytest
import yaml

from gemma_spec_ros.engine.config import (EngineConfig, ModelConfig, SamplingParams, SpecConfig,
                                          SuffixConfig)
from gemma_spec_ros.engine.drafters import suffix_history
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.errors import CacheFormatError
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import Generated, build_engine, collect

REPO = Path(__file__).resolve().parents[2]
SCHEMA_TEXT = (REPO / "gemma_spec_ros" / "config" / "schemas" / "robot_plan.schema.json").read_text()
_SUITE = yaml.safe_load((REPO / "gemma_spec_ros" / "prompts" / "planner.yaml").read_text())
#: Two planner requests under one system prompt: the second's plan repeats much of the first's.
PLANNER_PROMPTS = [_SUITE["system"] + "\n\n" + item["text"] for item in _SUITE["prompts"][:2]]
SYSTEM = ("You control a mobile manipulator. Skills: move_to(place), pick(object), place(object, place), "
          "say(text). Answer with a numbered plan.\n")
PROMPTS = [SYSTEM + task for task in ("Task: bring the red cup to the sink.\nPlan:\n1.",
                                      "Task: bring the blue cup to the sink.\nPlan:\n1.",
                                      "Task: bring the red cup to the table.\nPlan:\n1.")]
SUFFIX_MODES = ("suffix", "suffix+lookup")
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)


def run(engine: Engine, prompt: str, mode: str, max_tokens: int = 64, **fields) -> Generated:
    return collect(engine, GenerationRequest(prompt, max_tokens=max_tokens, spec_mode=mode, **fields))


@pytest.fixture(scope="module")
def f16_engine(f16_model_path: Path) -> Iterator[Engine]:
    # fixed K: every step with a match drafts and rolls back (the policy could stop drafting)
    engine = build_engine(f16_model_path, n_ctx=2048, calibrate=True,
                          spec=SpecConfig(mode="off", draft_max=4, adaptive=False))
    yield engine
    engine.close()


def suffix_drafts(done: Generated) -> int:
    return done.stats.drafts_by_source.get("suffix", 0)


@pytest.mark.exact
@pytest.mark.timeout(900)
def test_greedy_suffix_modes_equal_plain_decoding_token_for_token(exact_build: None, f16_engine: Engine) -> None:
    """Plain decoding first: its outputs join the suffix history (it learns in every mode), so the
    suffix modes draft long stretches of them; fixed K 4, then adaptive K 8 with cut drafts."""
    plain = [run(f16_engine, prompt, "off").tokens for prompt in PROMPTS]
    drafted = accepted = 0
    for spec in (f16_engine.spec, replace(f16_engine.spec, draft_max=8, adaptive=True)):
        f16_engine.update_spec(spec)
        try:
            for mode in SUFFIX_MODES:
                for prompt, reference in zip(PROMPTS, plain):
                    done = run(f16_engine, prompt, mode)
                    assert done.tokens == reference, f"{mode} (K {spec.draft_max}) differs from off"
                    drafted += suffix_drafts(done)
                    accepted += done.stats.num_accepted_tokens
        finally:
            f16_engine.update_spec(replace(spec, draft_max=4, adaptive=False))
    assert drafted > 0 and accepted > 0, "the suffix drafter never drafted: parity would be vacuous"


@pytest.mark.exact
@pytest.mark.timeout(900)
def test_seeded_sampling_with_suffix_drafts_equals_off_under_exact_verification(exact_build: None,
                                                                                f16_engine: Engine) -> None:
    drafted = 0
    for prompt in PROMPTS[:2]:
        reference = run(f16_engine, prompt, "off", sampling=SEEDED).tokens
        for mode in SUFFIX_MODES:
            done = run(f16_engine, prompt, mode, sampling=SEEDED)
            assert done.tokens == reference, mode
            drafted += suffix_drafts(done)
        other = run(f16_engine, prompt, "off", sampling=replace(SEEDED, seed=99)).tokens
        assert other != reference  # the seed matters: the equality above is not vacuous
    assert drafted > 0


@pytest.mark.exact
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_constrained_suffix_modes_equal_constrained_plain_decoding(exact_build: None, f16_engine: Engine,
                                                                   sampling: SamplingParams) -> None:
    """Under the plan schema: the text the grammar forces first, then the suffix draft cut before the
    first token the grammar refuses; the second plan is drafted from the first one's history."""
    forced = drafted = 0
    for prompt in PLANNER_PROMPTS:
        plain = run(f16_engine, prompt, "off", 400, json_schema=SCHEMA_TEXT, sampling=sampling)
        jsonschema.validate(json.loads(plain.text), json.loads(SCHEMA_TEXT))
        for mode in SUFFIX_MODES:
            done = run(f16_engine, prompt, mode, 400, json_schema=SCHEMA_TEXT, sampling=sampling)
            assert done.tokens == plain.tokens, f"{mode} differs from constrained plain decoding"
            forced += done.stats.num_grammar_accepted_tokens
            drafted += suffix_drafts(done)
    assert forced > 0 and drafted > 0, (forced, drafted)


def tried(engine: Engine, drafter: str) -> float:
    """How many draft tokens (decayed) the drafter's evidence model has been taught in hindsight."""
    return sum(engine.drafters[drafter].policy.evidence.tried.values())


#: adaptive K 8: a drafter that cuts its drafts proposes the whole cap and its policy cuts each one
CUTTING = SpecConfig(mode="off", draft_max=8, adaptive=True)


@pytest.mark.exact
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_constrained_suffix_drafts_cut_by_the_policy_equal_constrained_plain_decoding(
        exact_build: None, f16_model_path: Path, sampling: SamplingParams) -> None:
    """Under the plan schema at adaptive K: the forced text, then the suffix draft cut before the
    first refused token and then by its policy (the forced rows counted), its whole draft settled in
    hindsight. A fresh engine, so that the suffix policy's evidence model starts empty: plain decoding
    fills the history but teaches no evidence, so what it has learned at the end came from the
    constrained drafts."""
    with build_engine(f16_model_path, n_ctx=2048, calibrate=True, spec=CUTTING) as engine:
        plain = [run(engine, prompt, "off", 400, json_schema=SCHEMA_TEXT, sampling=sampling).tokens
                 for prompt in PLANNER_PROMPTS]
        assert tried(engine, "suffix") == 0
        drafted = 0
        for mode in SUFFIX_MODES:
            for prompt, reference in zip(PLANNER_PROMPTS, plain):
                done = run(engine, prompt, mode, 400, json_schema=SCHEMA_TEXT, sampling=sampling)
                assert done.tokens == reference, f"{mode} differs from constrained plain decoding"
                drafted += suffix_drafts(done)
        assert drafted > 0, "the suffix drafter never drafted: parity would be vacuous"
        assert tried(engine, "suffix") > 0, "no constrained draft was settled in hindsight"


@pytest.mark.timeout(600)
def test_under_a_grammar_only_the_suffix_policy_cuts_its_drafts_and_learns_from_them(
        embedded_model_path: Path) -> None:
    """The suffix drafter cuts its constrained drafts (Drafter.cuts_constrained_drafts), so under the
    plan schema its whole drafts teach its policy; the lookup drafter keeps the per-step length of its
    policy there, so a constrained lookup request settles nothing. Plain decoding first: its answer
    is in the suffix history and the lookup cache, and it teaches neither policy."""
    with build_engine(embedded_model_path, n_ctx=2048, calibrate=True, spec=CUTTING) as engine:
        run(engine, PLANNER_PROMPTS[0], "off", 400, json_schema=SCHEMA_TEXT)
        by_lookup = run(engine, PLANNER_PROMPTS[1], "lookup", 400, json_schema=SCHEMA_TEXT)
        assert by_lookup.stats.drafts_by_source.get("lookup", 0) > 0, "lookup never drafted: vacuous"
        assert tried(engine, "lookup") == 0 and tried(engine, "suffix") == 0
        done = run(engine, PLANNER_PROMPTS[1], "suffix", 400, json_schema=SCHEMA_TEXT)
        jsonschema.validate(json.loads(done.text), json.loads(SCHEMA_TEXT))
        assert suffix_drafts(done) > 0 and done.stats.num_accepted_tokens > 0
        assert tried(engine, "suffix") > 0 and tried(engine, "lookup") == 0


@pytest.mark.timeout(600)
def test_a_sampled_plan_with_suffix_drafts_validates_under_rejection_verification(embedded_model_path: Path) -> None:
    """Rejection verification takes a suffix draft as a point mass (q = 1 on the drafted token): the
    output is distributed as plain sampling, so what can be checked per run is a valid plan."""
    with build_engine(embedded_model_path, n_ctx=2048,
                      spec=SpecConfig(mode="suffix", draft_max=4, adaptive=False, verification="rejection")) as engine:
        drafted = 0
        for prompt in PLANNER_PROMPTS:
            done = run(engine, prompt, "suffix", 400, json_schema=SCHEMA_TEXT, sampling=SEEDED)
            jsonschema.validate(json.loads(done.text), json.loads(SCHEMA_TEXT))
            drafted += suffix_drafts(done)
    assert drafted > 0


@pytest.mark.timeout(300)
def test_suffix_drafting_time_is_in_the_steps_draft_time(embedded_model_path: Path) -> None:
    """The step profile's draft time (stats.draft_time, per pass: bench record.step_profile) counts
    the suffix drafter's work as any drafter's, and the cost model learns its time per token."""
    spec = SpecConfig(mode="suffix", draft_max=4, adaptive=False)
    with build_engine(embedded_model_path, n_ctx=1024, spec=spec) as engine:
        run(engine, PROMPTS[0], "off", 32)  # the history holds this answer
        done = run(engine, PROMPTS[0], "suffix", 32)
        assert suffix_drafts(done) > 0 and done.stats.draft_time > 0
        assert engine.costs.draft_cost("suffix", 1) > 0


def history_engine(model: Path, folder: Path) -> Engine:
    config = EngineConfig(ModelConfig(str(model), n_ctx=1024),
                          spec=SpecConfig(mode="suffix", draft_max=4, adaptive=False),
                          suffix=SuffixConfig(history_path=str(folder / "suffix-history.bin"), cache_dir=str(folder)))
    return Engine(config, calibrate=False)


@pytest.mark.timeout(300)
def test_the_history_is_saved_at_close_and_drafts_in_the_next_engine(
        embedded_model_path: Path, tmp_path: Path) -> None:
    with history_engine(embedded_model_path, tmp_path) as first:
        answer: List[int] = run(first, PROMPTS[0], "off", 32).tokens
    path = tmp_path / "suffix-history.bin"
    [saved] = suffix_history.load(path, _vocab_tag(embedded_model_path))
    assert saved == answer
    with history_engine(embedded_model_path, tmp_path) as second:
        done = run(second, PROMPTS[0], "suffix", 32)
    # the same prompt: its answer drafted from the loaded history (the quantized target's output
    # equals plain decoding's only up to near-ties: the exact tests above check that)
    assert suffix_drafts(done) > 0 and done.stats.num_accepted_tokens > 0


def _vocab_tag(model: Path) -> str:
    from gemma_spec_ros.engine.llama.model import LlamaModel
    target = LlamaModel(ModelConfig(str(model), n_ctx=64))
    try:
        return target.vocab_tag()
    finally:
        target.close()


@pytest.mark.timeout(300)
def test_a_foreign_history_fails_the_engine_and_a_damaged_one_is_moved_aside(
        embedded_model_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "suffix-history.bin"
    path.write_bytes(b"not a history\n")
    with pytest.raises(CacheFormatError, match="not a suffix history"):
        history_engine(embedded_model_path, tmp_path)
    assert path.read_bytes() == b"not a history\n"
    path.unlink()
    suffix_history.save([[1, 2, 3]], path, _vocab_tag(embedded_model_path))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with history_engine(embedded_model_path, tmp_path) as engine:
        assert any("moved it to" in w and "suffix history" in w for w in engine.warnings), engine.warnings
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data)
