"""Hostile constraints on the real Gemma 3 270M (engine/grammar/matcher.py, engine/grammar/gbnf.py): a constraint of a
few bytes from any client must neither hang the engine nor crash the process, and checking one
costs bounded work.

- an ambiguous grammar and a recursive schema (whose llama.cpp grammar state doubled per character:
  73 s for one character at the 15th) cost bounded work per token, and a cancel ends them at once;
- constraints whose conversion wrote 20,000 nested groups, or whose grammar nested rules deeper
  than a thread's stack, are refused or served in a child process, which must exit normally
  (a segmentation fault there fails the test instead of killing pytest);
- a 64 KiB grammar is refused by a rule on its shape or size, before any work grows with it, and a
  goal's constraint is compiled once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from gemma_spec_ros.engine.grammar import matcher as grammar_module
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.grammar.matcher import compiled_constraint
from gemma_spec_ros.engine.config import SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine, collect

#: 39 bytes: every character so far may be matched by any number of pending "1"/"2" closers.
AMBIGUOUS_GRAMMAR = 'root ::= x\nx ::= . x "1" | . x "2" | ""'
#: Arrays of arrays, by two branches of which one allows at most one item: every "[" is ambiguous.
RECURSIVE_SCHEMA = json.dumps({"anyOf": [{"type": "array", "items": {"$ref": "#"}},
                                         {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}]},
                              indent=4)
#: Tokens a hostile request must emit before it is cancelled (the old engine took minutes for 15).
TOKENS_BEFORE_CANCEL = 24
K64 = 1 << 16


@pytest.fixture(scope="module")
def engine(embedded_model_path: Path) -> Iterator[Engine]:
    with build_engine(embedded_model_path, n_ctx=1024, spec=SpecConfig(mode="off")) as engine:
        yield engine


# -- bounded work per token, and cancel ---------------------------------------------------------------
class Consumer:
    """A request's steps consumed in a thread of their own, as the node's dispatcher does."""

    def __init__(self, engine: Engine, request: GenerationRequest) -> None:
        self.cancel = threading.Event()
        self.tokens: List[int] = []
        self.finish = ""
        self.error: BaseException = None  # type: ignore[assignment]
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(engine, request), daemon=True)
        self.thread.start()

    def _run(self, engine: Engine, request: GenerationRequest) -> None:
        try:
            for step in engine.generate(request, self.cancel):
                self.tokens.extend(step.tokens)
                self.finish = step.finish_reason or ""
        except BaseException as exc:  # noqa: BLE001  reported by the test
            self.error = exc
        finally:
            self.ended.set()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fields, prompt", [
    ({"grammar": AMBIGUOUS_GRAMMAR}, "Write a short story about a robot:"),
    ({"json_schema": RECURSIVE_SCHEMA}, "Nested lists: [[[[[[[[[[[[[[[[[[[[[[[["),
], ids=["ambiguous-grammar", "recursive-schema"])
def test_an_ambiguous_constraint_costs_bounded_work_per_token_and_a_cancel_ends_it(
        engine: Engine, fields: Dict[str, str], prompt: str) -> None:
    consumer = Consumer(engine, GenerationRequest(prompt, max_tokens=400, **fields))
    deadline = time.monotonic() + 240
    while len(consumer.tokens) < TOKENS_BEFORE_CANCEL and not consumer.ended.is_set():
        assert time.monotonic() < deadline, f"{len(consumer.tokens)} tokens in 240 s: the grammar's work grew"
        time.sleep(0.01)
    assert consumer.error is None, consumer.error
    if consumer.ended.is_set():  # the constraint let the text end: it was served whole
        assert consumer.finish == "stop" and consumer.tokens, consumer.finish
        return
    cancelled_at = time.monotonic()
    consumer.cancel.set()
    assert consumer.ended.wait(10)
    assert time.monotonic() - cancelled_at < 1.0, "the cancel waited for the grammar"
    assert consumer.error is None and consumer.finish == "cancelled", (consumer.error, consumer.finish)
    assert collect(engine, GenerationRequest("Hello", max_tokens=2)).steps[-1].finish_reason == "length"


# -- never a crash: in a child process ------------------------------------------------------------------
CHILD = """
import json, resource, sys
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.config import EngineConfig, ModelConfig
from gemma_spec_ros.engine.request import GenerationRequest
engine = Engine(EngineConfig(ModelConfig(sys.argv[1], n_ctx=256)), calibrate=False)
request = GenerationRequest("Name:", max_tokens=4, **json.load(open(sys.argv[2])))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    engine.check_request(request)
except ValueError as exc:
    print("refused:", exc)
else:
    print("served:", [step.finish_reason for step in engine.generate(request)][-1])
print("peak rss growth KiB:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
engine.close()
"""


def _compact_ref_chain(levels: int) -> str:
    defs: Dict[str, Any] = {f"d{i}": {"items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs}, separators=(",", ":"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fields", [
    {"json_schema": '{"type": "string", "maxLength": 20000}'},  # 38 bytes: 20,001 nested groups once
    {"json_schema": '{"type": "array", "maxItems": 100000, "items": {"type": "string"}}'},
    {"json_schema": '{"type": "string", "minLength": 50000000}'},  # 0.7 GiB of grammar text once
    {"grammar": "root ::= " + "(" * 32000 + '"a"' + ")" * 32000},  # nested groups inside 64 KiB
    {"grammar": "root ::= a0\n" + "".join(f'a{i}::="a" a{i + 1} "b"|"c"\n' for i in range(1000))
     + 'a1000::="d"'},  # rules nested 1,000 deep
    {"json_schema": _compact_ref_chain(1500)},  # definitions nested 1,500 deep
], ids=["maxLength-20000", "maxItems-100000", "minLength-5e7", "nested-groups-64KiB",
        "rule-chain-1000", "ref-chain-1500"])
def test_a_hostile_constraint_is_refused_or_served_and_never_crashes(
        fields: Dict[str, str], embedded_model_path: Path, tmp_path: Path) -> None:
    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(fields))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(script), str(embedded_model_path), str(request_file)],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"the child exited with {proc.returncode}: {proc.stderr[-2000:]}"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(("refused:", "served:")), proc.stdout
    # the first constrained request builds llguidance's view of the vocabulary: ~130 MiB, measured
    growth_mib = int(lines[-1].rsplit(":", 1)[1]) / 1024
    assert growth_mib < 300, f"checking and serving the constraint took {growth_mib:.0f} MiB"


# -- bounded checks, compiled once ----------------------------------------------------------------------
def _filled(head: str, unit: str, tail: str = "") -> str:
    """``head`` + ``unit`` repeated + ``tail``, as close to 64 KiB as whole units come."""
    return head + unit * ((K64 - len(head) - len(tail)) // len(unit)) + tail


@pytest.mark.parametrize("grammar, reason", [
    ("root ::= " + "(" * (K64 // 2 - 8) + '"a"' + ")" * (K64 // 2 - 8), "nested more than 16 deep"),
    ("root ::= r0\n" + "".join(f'r{i} ::= "t" r{i + 1}\n' for i in range(3300)), "more than 1024 rules"),
    (_filled("root ::=", ' "a"{0,1999}'), "grammar size (number of symbols) too big"),
    (_filled("root ::=", ' "a"?', ' "."'), "grammar size (number of symbols) too big"),
    (_filled("root ::=", " [a-z0-9]{0,50}"), "grammar size (number of symbols) too big"),
], ids=["nesting", "rules", "repetitions", "optional-characters", "character-classes"])
def test_a_64k_grammar_is_refused_by_a_rule_on_its_shape_or_size(grammar: str, reason: str) -> None:
    """The grammars that cost llama.cpp's engine 15 s and 2.4 GiB to compile, or its parser a stack
    overflow: each one is refused by a bound that does not grow with its content (the converter's
    nesting and rule counts, llguidance's count of grammar symbols)."""
    assert K64 - 2048 < len(grammar.encode()) <= K64
    with pytest.raises(ValueError, match="grammar") as error:
        compiled_constraint(grammar=grammar)
    assert reason in str(error.value)


def test_a_goals_constraint_is_compiled_once(engine: Engine) -> None:
    """The goal check compiles the constraint; generate() (and the next goal with the same text)
    takes the compiled grammar from the cache."""
    request = GenerationRequest("Is the cup red? Answer:", max_tokens=4,
                                grammar='root ::= " yes" | " no" | " maybe"')
    misses = grammar_module._compiled.cache_info().misses
    engine.check_request(request)
    assert grammar_module._compiled.cache_info().misses == misses + 1
    for _ in range(2):
        assert collect(engine, request).text in (" yes", " no", " maybe")
    assert grammar_module._compiled.cache_info().misses == misses + 1


def test_compiling_constraints_leaves_the_process_stderr_alone(capfd: pytest.CaptureFixture) -> None:
    """Compiling once pointed file descriptor 2 at a temporary file while llama.cpp parsed: what any
    other thread wrote meanwhile was lost, and a refusal's reason could quote it. While 40 bad
    grammars are refused, another thread's 200 writes to fd 2 all arrive, and no reason quotes them."""
    stop = threading.Event()

    def write() -> None:
        for i in range(200):
            os.write(2, f"other-thread-{i}\n".encode())
            time.sleep(0.0005)
        stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    reasons = []
    while not stop.is_set() or len(reasons) < 40:
        with pytest.raises(ValueError) as refused:
            compiled_constraint(f"root ::= undefined{len(reasons)}", "")
        reasons.append(str(refused.value))
    writer.join()
    err = capfd.readouterr().err
    assert all(f"other-thread-{i}\n" in err for i in range(200))
    assert not [reason for reason in reasons if "other-thread" in reason]
