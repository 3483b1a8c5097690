"""Constrained output (engine/grammar.py): llama.cpp's grammar engine on the real Gemma 3 270M.

- every mode's constrained output parses and validates against the planner suite's plan schema;
- exactly the output of constrained plain decoding in every mode (greedy and seeded sampling,
  under the exact build with the F16 copy: the tests marked ``exact`` run in test/engine/test_exact_build.py's
  child), including drafts the grammar forced and drafts it cut;
- bad input is refused with llama.cpp's or the converter's reason, a grammar with a dead end or a
  state that grows too costly ends the request with an error and a reason, the engine serves the
  next request; max_tokens running out says the text is not a whole match.
"""
import json
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.grammar import GrammarError, GrammarVocab, gbnf_of
from gemma_spec_ros.engine.types import (EngineConfig, GenerationRequest, ModelConfig, SamplingParams,
                                         SpecConfig)
from support.engine import collect

REPO = Path(__file__).resolve().parents[2]
SCHEMA_TEXT = (REPO / "gemma_spec_ros" / "config" / "schemas" / "robot_plan.schema.json").read_text()
SCHEMA = json.loads(SCHEMA_TEXT)
_SUITE = yaml.safe_load((REPO / "gemma_spec_ros" / "prompts" / "planner.yaml").read_text())
PLANNER_PROMPT = _SUITE["system"] + "\n\n" + _SUITE["prompts"][0]["text"]  # cup-to-sink
MODES = ("off", "lookup", "draft", "draft+lookup", "auto")
MAX_TOKENS = 512  # the schema bounds a plan below this (see its $comment)


def run(engine, mode, max_tokens=MAX_TOKENS, prompt=PLANNER_PROMPT, **kw):
    request = GenerationRequest(prompt, max_tokens=max_tokens, spec_mode=mode, **kw)
    done = collect(engine, request)
    return done.tokens, done.text, done.steps[-1]


def engine_for(target, draft):
    return Engine(EngineConfig(
        target=ModelConfig(str(target), n_ctx=2048), draft=ModelConfig(str(draft), n_ctx=2048),
        # fixed K, so that every speculative mode drafts and cuts (the policy could stop drafting)
        spec=SpecConfig(mode="off", draft_max=4, adaptive=False)))


@pytest.fixture(scope="module")
def engine(embedded_model_path):
    with engine_for(embedded_model_path, embedded_model_path) as engine:
        yield engine


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, reason", [
    ({"grammar": 'root ::= "a" | foo'}, "Undefined rule identifier 'foo'"),
    ({"grammar": 'root ::= root "a"'}, "left recursion"),
    ({"grammar": 'root ::= "a'}, "unexpected end of input"),
    ({"grammar": 'start ::= "a"'}, "'root'"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "must be a JSON object"),
    ({"json_schema": '{"not": {"type": "string"}}'}, "Unrecognized schema"),
    ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "Error resolving ref"),
])
def test_a_constraint_that_does_not_parse_is_refused_with_the_reason(engine, fields, reason):
    request = GenerationRequest("Plan:", max_tokens=8, **fields)
    with pytest.raises(ValueError, match="grammar|json_schema") as info:
        engine.check_request(request)
    assert reason in str(info.value)
    # nothing was broken: the next request runs
    assert run(engine, "off", max_tokens=4, prompt="Hello")[2].finish_reason == "length"


def test_both_constraints_and_oversized_ones_are_refused():
    with pytest.raises(ValueError, match="at most one"):
        GenerationRequest("x", grammar='root ::= "a"', json_schema='{"type": "string"}')
    with pytest.raises(ValueError, match="limits.max_grammar_bytes"):
        gbnf_of(grammar='root ::= "' + "a" * 2000 + '"', max_bytes=1024)


# -- the planner's plans ----------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_every_mode_gives_a_plan_that_parses_and_validates(engine):
    forced = cut = 0
    for mode in MODES:
        _, text, last = run(engine, mode, json_schema=SCHEMA_TEXT)
        assert last.finish_reason == "stop", (mode, text)
        jsonschema.validate(json.loads(text), SCHEMA)  # raises with the path of what is wrong
        forced += last.stats.num_grammar_accepted_tokens
        cut += last.stats.num_grammar_cut_tokens
        if mode == "off":
            assert last.stats.num_grammar_draft_tokens == 0, "off drafts nothing, not even forced text"
    assert forced > 0, "the grammar never supplied a draft token: the grammar drafter did not run"
    assert cut > 0, "no draft was ever cut by the grammar: that path went untested"


def test_a_sampled_plan_validates_under_both_verifications(engine):
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    for verification in ("exact", "rejection"):
        engine.update_spec(SpecConfig(mode="off", draft_max=4, adaptive=False, verification=verification))
        try:
            _, text, last = run(engine, "draft+lookup", json_schema=SCHEMA_TEXT, sampling=sampling)
        finally:
            engine.update_spec(SpecConfig(mode="off", draft_max=4, adaptive=False))
        assert last.finish_reason == "stop", (verification, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_gbnf_grammar_bounds_the_answer(engine):
    _, text, last = run(engine, "lookup", prompt="Is the cup red? Answer:",
                        grammar='root ::= " " ("yes" | "no") "."')
    assert text in (" yes.", " no.") and last.finish_reason == "stop"


def test_max_tokens_before_the_grammar_is_complete_says_so(engine):
    _, text, last = run(engine, "lookup", max_tokens=6, prompt="A plan in JSON:", json_schema=SCHEMA_TEXT)
    assert last.finish_reason == "length" and text.startswith("{")
    assert "not a whole match" in last.detail
    _, _, done = run(engine, "lookup", prompt="Is the cup red? Answer:", grammar='root ::= " yes"')
    assert done.detail == ""


# -- grammars that stop the request -------------------------------------------------------------------
def test_a_dead_end_ends_the_request_with_the_reason_and_the_engine_goes_on(engine):
    # after "a" only a NUL character may follow, and no token can spell it
    with pytest.raises(GrammarError, match="admits no token"):
        run(engine, "lookup", prompt="Say a:", grammar=r'root ::= "a" [\x00]')
    assert run(engine, "lookup", max_tokens=4, prompt="Hello")[2].finish_reason == "length"


@pytest.mark.timeout(120)
def test_a_grammar_whose_state_explodes_is_stopped_before_it_hangs_the_engine(engine):
    # 300 optional characters in a row: one whole-row mask would take minutes on this CPU; the mask
    # times its first candidates and refuses the row (measured: refused after ~0.3 s, the time its first sample of 16 tokens takes)
    exploding = "root ::= " + " ".join(['"a"?'] * 300) + ' "."'
    with pytest.raises(GrammarError, match="state grew too large"):  # sampled: whole-row masks
        run(engine, "off", prompt="Write b:", grammar=exploding,
            sampling=SamplingParams(temperature=1.0, seed=1))
    assert run(engine, "off", max_tokens=4, prompt="Hello")[2].finish_reason == "length"


def test_a_burst_of_load_during_a_probe_does_not_end_the_request(engine):
    """A whole-row mask first times samples of the vocabulary (grammar.MASK_PROBES). A stall of the
    host inside one probe (simulated: the first call into llama.cpp sleeps, since no real grammar is
    slow exactly once) predicts minutes for the row; the probe is timed again and the row is masked.
    A grammar slow at every try is still refused."""
    grammar = GrammarVocab.of(engine.target).compile('root ::= " yes" | " no"')
    real, calls = grammar._apply, []

    def stalled_once(data):
        calls.append(len(data))
        if len(calls) == 1:
            time.sleep(0.5)  # 0.5 s for 16 tokens: ~8,000 s predicted for the 262k-token row
        real(data)

    grammar._apply = stalled_once
    masked = grammar.mask(np.zeros(engine.target.n_vocab, dtype=np.float32))
    assert calls[0] == calls[1] and calls[-1] == engine.target.n_vocab  # probed again, then the row
    assert 2 <= np.isfinite(masked).sum() < 100  # " yes", " no" and the pieces they start with

    def stalled_always(data):
        time.sleep(0.2)
        real(data)

    grammar._apply = stalled_always
    with pytest.raises(GrammarError, match="state grew too large"):
        grammar.mask(np.zeros(engine.target.n_vocab, dtype=np.float32))
    grammar.close()


# -- lossless: exactly constrained plain decoding ---------------------------------------------------
@pytest.fixture(scope="module")
def f16_engine(f16_model_path, embedded_model_path):
    with engine_for(f16_model_path, embedded_model_path) as engine:
        yield engine


@pytest.mark.exact
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3)],
                         ids=["greedy", "seeded"])
def test_constrained_speculation_equals_constrained_plain_decoding(exact_build, f16_engine, sampling):
    plain, text, _ = run(f16_engine, "off", json_schema=SCHEMA_TEXT, sampling=sampling)
    jsonschema.validate(json.loads(text), SCHEMA)
    forced = cut = 0
    for mode in MODES[1:]:
        tokens, _, last = run(f16_engine, mode, json_schema=SCHEMA_TEXT, sampling=sampling)
        assert tokens == plain, f"{mode} differs from constrained plain decoding"
        forced += last.stats.num_grammar_accepted_tokens
        cut += last.stats.num_grammar_cut_tokens
    assert forced > 0 and cut > 0, (forced, cut)
