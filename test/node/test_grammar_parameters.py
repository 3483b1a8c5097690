"""The node's default constraint (``generation.grammar`` / ``generation.json_schema``) on real rclpy,
on the embedded Gemma 3 270M: a default is checked when it is set exactly as a goal's constraint is
(parsed and compiled), so a default that does not compile is refused by the parameter set and
never reaches a goal; one that compiles constrains the goals that set none.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from gemma_spec_ros.client import GenerateClient
from gemma_spec_ros.node.parameters import defaults
from support.node import greedy_answer

NODE = "gemma_spec_grammar_parameters"


@pytest.fixture(scope="module")
def client(node_client: Callable[..., Any], embedded_model_path: Path) -> GenerateClient:
    values = {"target.model_path": str(embedded_model_path), "target.n_ctx": 512,
              "spec.mode": "off", "lookup.dynamic_path": "", "diagnostics.period": 0.5}
    return node_client(NODE, {k: v for k, v in values.items() if v != defaults().get(k)}).client


def answer(client: GenerateClient, **fields: Any) -> Any:
    return greedy_answer(client, "Is the cup red? Answer:", 6, **fields)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, value, reason", [
    ("generation__grammar", "root ::= nope", "rule 'nope' is used but not defined"),
    ("generation__grammar", 'root ::= "a" | ' + "(" * 40 + '"b"' + ")" * 40, "nested more than 16 deep"),
    ("generation__json_schema", '{"type": "strin"}', "Invalid type: strin"),
    ("generation__json_schema", '{"type": "string", "pattern": "(?=a)"}', "look-around"),
])
def test_a_default_constraint_that_does_not_compile_is_refused_and_goals_keep_working(
        client: GenerateClient, name: str, value: str, reason: str) -> None:
    [result] = client.set_parameters(**{name: value})
    assert not result.successful and reason in result.reason, result.reason
    assert client.get_parameters([name.replace("__", ".")])[name.replace("__", ".")] == ""
    assert answer(client).finish_reason == "length"  # unconstrained, as before the refused set


@pytest.mark.timeout(300)
def test_a_default_constraint_that_compiles_constrains_goals_that_set_none(client: GenerateClient) -> None:
    [result] = client.set_parameters(generation__grammar='root ::= " yes" | " no"')
    assert result.successful, result.reason
    try:
        done = answer(client)
        assert done.finish_reason == "stop" and done.text in (" yes", " no"), done
        own = answer(client, grammar='root ::= " maybe"')  # a goal's own constraint wins
        assert own.text == " maybe", own
    finally:
        assert all(r.successful for r in client.set_parameters(generation__grammar=""))


def rss_bytes() -> int:
    """This process's resident set (the node runs in it)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.timeout(300)
def test_a_default_schema_of_a_huge_length_is_set_without_unbounded_work(client: GenerateClient) -> None:
    """A 41-byte schema set as the default (``minLength`` 5e7): the converter of llama.cpp's
    grammar engine wrote ~15 bytes per unit of it in the parameter callback (0.7 GiB here). Now
    the set is answered, the process grows by less than 300 MiB, and a goal is served under it."""
    before = rss_bytes()
    [result] = client.set_parameters(generation__json_schema='{"type":"string","minLength":50000000}')
    try:
        assert result.successful, result.reason
        assert rss_bytes() - before < 300 << 20
        done = answer(client)
        assert done.finish_reason == "length" and done.text.startswith('"'), done
    finally:
        assert all(r.successful for r in client.set_parameters(generation__json_schema=""))


@pytest.mark.timeout(300)
def test_a_grammar_limit_past_the_engine_s_bound_is_refused(client: GenerateClient) -> None:
    """``limits.max_grammar_bytes`` stops at the engine's 64 KiB: a grammar of 1 MiB once compiled
    for minutes in the goal callback."""
    [result] = client.set_parameters(limits__max_grammar_bytes=1 << 20)
    assert not result.successful
    assert client.get_parameters(["limits.max_grammar_bytes"])["limits.max_grammar_bytes"] <= 1 << 16
