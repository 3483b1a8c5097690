"""Constrained output (engine/grammar/matcher.py): llguidance's grammar engine on the real Gemma 3 270M.

- every mode's constrained output parses and validates against the planner suite's plan schema;
- exactly the output of constrained plain decoding in every mode (greedy and seeded sampling,
  under the exact build with the F16 copy: the tests marked ``exact`` run in test/engine/test_exact_build.py's
  child), including drafts the grammar forced and drafts it cut, over the plan schema and over a
  schema with bounded numbers, ``oneOf`` and a pattern;
- the grammar state itself: forced tokens, the draft check, rollback;
- bad input is refused with the converter's or llguidance's reason, a grammar that needs more work
  per token than the parser's bounds ends the request with an error and a reason, the engine serves
  the next request; max_tokens running out says the text is not a whole match.
"""
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml

from gemma_spec_ros.engine.grammar.matcher import GrammarError, GrammarVocab, compiled_constraint
from gemma_spec_ros.engine.config import SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.sampling import Sampler, allowed_tokens, make_rng, verify_exact, verify_rejection
from support.engine import build_engine, collect

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
    return build_engine(
        target, draft, n_ctx=2048, calibrate=True,
        # fixed K, so that every speculative mode drafts and cuts (the policy could stop drafting)
        spec=SpecConfig(mode="off", draft_max=4, adaptive=False))


@pytest.fixture(scope="module")
def engine(embedded_model_path):
    with engine_for(embedded_model_path, embedded_model_path) as engine:
        yield engine


def test_an_engine_that_prepares_the_grammar_builds_its_tokenizer_at_load(embedded_model_path, monkeypatch):
    """EngineConfig.prepare_grammar: llguidance's tokenizer of the vocabulary is built while the
    engine loads, not by the first constrained request (the build holds Python's GIL for about a
    second and a half: a node's other threads would stall under a goal). When it runs is seen by
    making the build fail once both engines are loaded (a monkeypatch: nothing real fails there):
    the prepared engine serves a plan, the other fails on its first constrained request."""
    from gemma_spec_ros.engine.config import EngineConfig, ModelConfig
    from gemma_spec_ros.engine.engine import Engine

    def engine(prepare):
        return Engine(EngineConfig(target=ModelConfig(str(embedded_model_path), n_ctx=2048),
                                   prepare_grammar=prepare), calibrate=False)

    with engine(True) as prepared, engine(False) as lazy:
        def build_now(cls, backend):
            raise RuntimeError("the tokenizer was built by the request")
        monkeypatch.setattr(GrammarVocab, "of", classmethod(build_now))
        request = GenerationRequest(PLANNER_PROMPT, max_tokens=24, json_schema=SCHEMA_TEXT)
        done = collect(prepared, request)
        assert done.text.startswith("{") and done.steps[-1].finish_reason == "length"
        with pytest.raises(RuntimeError, match="built by the request"):
            collect(lazy, request)


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, reason", [
    ({"grammar": 'root ::= "a" | foo'}, "rule 'foo' is used but not defined"),
    ({"grammar": 'root ::= "a'}, "unexpected character at line 1, column 10"),
    ({"grammar": 'start ::= "a"'}, "no rule 'root'"),
    ({"grammar": 'root ::= "\\q"'}, "unknown or incomplete escape"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "must be a JSON object"),
    ({"json_schema": '{"not": {"type": "string"}}'}, "Unimplemented keys"),
    ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "does not exist"),
    ({"json_schema": '{"type": "string", "pattern": "(?=a)"}'}, "look-around"),
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
        compiled_constraint(grammar='root ::= "' + "a" * 2000 + '"', max_bytes=1024)


def test_left_recursion_is_a_grammar_like_any_other(engine):
    """llguidance's Earley parser takes left-recursive rules (llama.cpp's engine refused them)."""
    _, text, last = run(engine, "lookup", max_tokens=8, prompt="Count in ones: 1",
                        grammar='root ::= list "."\nlist ::= list "1" | "1"')
    assert set(text) <= {"1", "."} and text.startswith("1"), text


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
        assert last.stats.num_grammar_sole_rows > 0, verification  # rows verified without logits


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
def test_a_grammar_past_the_parser_bounds_ends_the_request_with_the_reason(engine):
    """800 optional characters in a row: the Earley items of the first token exceed the bound on
    one step's work (grammar.PARSER_LIMITS), llguidance stops that step with its reason, and the
    engine serves the next request."""
    exploding = "root ::= " + " ".join(['"a"?'] * 800) + ' "."'
    with pytest.raises(GrammarError, match="Too many items"):
        run(engine, "off", prompt="Write b:", grammar=exploding)
    assert run(engine, "off", max_tokens=4, prompt="Hello")[2].finish_reason == "length"


# -- the grammar state: forced tokens, the draft check, rollback ------------------------------------
@pytest.fixture(scope="module")
def vocab(engine):
    return GrammarVocab.of(engine.target)


def test_forced_tokens_spell_the_text_the_schema_forces_as_the_model_tokenizes_it(engine, vocab):
    grammar = vocab.start(compiled_constraint(json_schema=SCHEMA_TEXT))
    forced = grammar.forced_tokens(16)
    text = b"".join(engine.target.token_bytes(t) for t in forced).decode()
    assert '{"goal": "'.startswith(text) and text.startswith('{"goal'), text  # the schema's first key
    assert forced == engine.target.tokenize(text, add_special=False)
    assert grammar.forced_tokens(1) == forced[:1]


def test_the_draft_check_and_rollback(engine, vocab):
    """``allowed_after`` stops before the first token the grammar refuses and before an
    end-of-generation token, after the text the grammar forces and without moving the state;
    ``advance`` + ``rollback`` leave the state where it was."""
    target = engine.target
    grammar = vocab.start(compiled_constraint(grammar='root ::= " yes." | " no."'))
    yes, dot, no = (target.tokenize(t, add_special=False) for t in (" yes", ".", " no"))
    assert grammar.allowed_after((), yes + dot + no) == len(yes + dot)
    before = grammar.allowed().dense().copy()
    assert grammar.allowed_after(yes, dot + [target.eos]) == len(dot)
    grammar.advance(yes)
    assert grammar.allowed_after((), dot + [target.eos]) == len(dot)
    grammar.rollback(len(yes))
    assert (grammar.allowed().dense() == before).all()
    assert grammar.allowed_after((), no + dot) == len(no + dot)
    grammar.advance(no + dot)
    allowed = grammar.allowed()
    assert grammar.complete() and target.eos in allowed and no[0] not in allowed


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)],
                         ids=["greedy", "seeded"])
def test_a_row_whose_token_the_grammar_allows_alone_verifies_without_its_logits(engine, vocab, sampling):
    """After " yes" the grammar allows "." alone: the step's masks have none for that row, and
    both verifications take its token from no row, draw what they draw with its masked row, and
    emit what they emit with every row and mask (engine.py asks the target for no logits there)."""
    target = engine.target
    constraint = compiled_constraint(grammar='root ::= " yes." | " no."')
    yes, dot = (target.tokenize(t, add_special=False) for t in (" yes", "."))
    assert len(yes) == len(dot) == 1
    grammar = vocab.start(constraint)
    before = grammar.allowed().dense().copy()
    masks = grammar.row_masks(yes + dot)
    assert (grammar.allowed().dense() == before).all()  # the state is where it was
    every = []  # each row's mask, computed one by one
    for token in (*yes, *dot, None):
        every.append(grammar.allowed().bits.copy())
        if token is not None:
            grammar.accept(token)
    assert [m is None for m in masks] == [False, True, False]
    assert (masks[0] == every[0]).all() and (masks[2] == every[2]).all()
    assert np.flatnonzero(allowed_tokens(every[1], target.n_vocab)).tolist() == dot  # the sole choice
    noise = np.random.default_rng(0).normal(size=target.n_vocab).astype(np.float32)
    first = noise.copy()
    first[yes[0]] = 50.0  # the target's choice, sampled or greedy
    sampler = Sampler(sampling)
    for verify in (verify_exact, lambda *a: verify_rejection(a[0], a[1], None, *a[2:])):
        verdicts, draws = [], []
        for rows, row_masks in (([first, noise, noise], every), ([first, None, noise], masks)):
            rng = make_rng(7)  # the same stream for both (greedy exact draws from neither)
            verdicts.append(verify(rows, yes + dot, sampler, rng, row_masks))
            draws.append(rng.random())
        assert verdicts[0] == verdicts[1] and verdicts[0].num_accepted == 2, verdicts
        assert target.is_eog(verdicts[0].tokens[-1])  # the grammar is complete: it allows the end alone
        assert draws[0] == draws[1]  # the same random numbers drawn


# -- lossless: exactly constrained plain decoding ---------------------------------------------------
@pytest.fixture(scope="module")
def f16_engine(f16_model_path, embedded_model_path):
    with engine_for(f16_model_path, embedded_model_path) as engine:
        yield engine


#: Bounded numbers, a oneOf (taken as anyOf: its branches exclude each other here) and patterns.
READING_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["sensor", "value", "unit", "ok"],
    "properties": {
        "sensor": {"type": "string", "pattern": "^[a-z]{3,8}_[0-9]{1,2}$"},
        "value": {"type": "number", "minimum": -40, "maximum": 125},
        "unit": {"oneOf": [{"const": "C"}, {"const": "K"}, {"type": "string", "pattern": "^[a-z]{2,4}$"}]},
        "ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 999}}}
READING_PROMPT = ("Sensor log of the robot, one JSON object per reading:\n"
                  '{"sensor": "motor_1", "value": 41.5, "unit": "C", "ok": true}\n')


@pytest.mark.exact
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3)],
                         ids=["greedy", "seeded"])
def test_constrained_speculation_equals_constrained_plain_decoding(exact_build, f16_engine, sampling):
    forced = cut = sole = 0
    for schema, prompt in ((SCHEMA, PLANNER_PROMPT), (READING_SCHEMA, READING_PROMPT)):
        schema_text = json.dumps(schema)
        plain, text, _ = run(f16_engine, "off", prompt=prompt, json_schema=schema_text, sampling=sampling)
        jsonschema.validate(json.loads(text), schema)
        for mode in MODES[1:]:
            tokens, _, last = run(f16_engine, mode, prompt=prompt, json_schema=schema_text, sampling=sampling)
            assert tokens == plain, f"{mode} differs from constrained plain decoding ({text!r})"
            forced += last.stats.num_grammar_accepted_tokens
            cut += last.stats.num_grammar_cut_tokens
            sole += last.stats.num_grammar_sole_rows  # rows verified without their logits
    assert forced > 0 and cut > 0 and sole > 0, (forced, cut, sole)
