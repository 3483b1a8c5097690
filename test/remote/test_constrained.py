"""Constrained output over the remote backend: a goal's ``grammar`` / ``json_schema``
reach the server in the form its kind takes, and a real llama.cpp ``llama-server`` returns text
the constraint allows. Skipped where scripts/build_native_tools.sh has not built llama-server; the
request bodies per kind and the refusals are checked without a server."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from gemma_spec_ros.engine.remote import (KIND_LLAMA_CPP_PYTHON, KIND_LLAMA_SERVER, KIND_OPENAI,
                                          KIND_VLLM, RemoteConfig, RemoteEngine, RemoteError)
from gemma_spec_ros.engine.remote.payload import completion_request
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.config import SpecConfig
from support.servers import LLAMA_SERVER, Server, free_port, llama_server

YES_NO = 'root ::= "yes" | "no"'
SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "count": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "count"], "additionalProperties": False,
}


def validate(value: Any, schema: Dict[str, Any]) -> None:
    """``value`` against ``schema``: with jsonschema where installed, else keys and types by hand."""
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == set(schema["required"]), value
        assert isinstance(value["name"], str) and len(value["name"]) <= 12, value
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 999, value
        return
    jsonschema.validate(value, schema)


# -- request bodies, no server ---------------------------------------------------------------------
def test_each_kind_gets_the_constraint_in_its_own_field() -> None:
    schema_text = json.dumps(SCHEMA)
    by_schema = GenerationRequest("Q", json_schema=schema_text)
    by_grammar = GenerationRequest("Q", grammar=YES_NO)
    assert completion_request(by_schema, KIND_LLAMA_SERVER, "")[1]["json_schema"] == SCHEMA
    assert completion_request(by_grammar, KIND_LLAMA_SERVER, "")[1]["grammar"] == YES_NO
    assert completion_request(by_schema, KIND_VLLM, "m")[1]["structured_outputs"] == {"json": SCHEMA}
    assert completion_request(by_grammar, KIND_VLLM, "m")[1]["structured_outputs"] == {"grammar": YES_NO}
    assert completion_request(by_grammar, KIND_LLAMA_CPP_PYTHON, "")[1]["grammar"] == YES_NO
    converted = completion_request(by_schema, KIND_LLAMA_CPP_PYTHON, "")[1]["grammar"]
    assert "root ::=" in converted and '\\"name\\"' in converted  # llama-cpp-python's converter
    chat = GenerationRequest("Q", grammar=YES_NO, use_chat_template=True)
    path, body = completion_request(chat, KIND_LLAMA_SERVER, "")
    assert path == "/v1/chat/completions" and body["grammar"] == YES_NO
    unconstrained = completion_request(GenerationRequest("Q"), KIND_LLAMA_SERVER, "")[1]
    assert not {"grammar", "json_schema", "structured_outputs"} & set(unconstrained)
    with pytest.raises(RemoteError, match="would ignore the constraint"):
        completion_request(by_grammar, KIND_OPENAI, "")


def test_a_schema_that_is_not_json_is_refused_before_any_request() -> None:
    """ValueError with the parser's reason, from the goal check and from generate, before any
    connection: the engine's server does not exist, so a request would have raised
    ServerUnreachableError."""
    engine = RemoteEngine(RemoteConfig(url=f"http://127.0.0.1:{free_port()}", connect_timeout=0.3,
                                       probe_period=0), SpecConfig(mode="off"))
    try:
        bad = GenerationRequest("Q", json_schema='{"type": "object",')
        with pytest.raises(ValueError, match=r"json_schema is not valid JSON \(.* line 1, column \d+\)"):
            engine.check_request(bad)
        with pytest.raises(ValueError, match="json_schema is not valid JSON"):
            list(engine.generate(bad))
        with pytest.raises(ValueError, match="not an object"):
            list(engine.generate(GenerationRequest("Q", json_schema="[1, 2]")))
    finally:
        engine.close()


# -- llama.cpp's llama-server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"llama-server not built at {LLAMA_SERVER} (scripts/build_native_tools.sh)")
    srv = llama_server(embedded_model_path, tmp_path_factory.mktemp("servers"), []).start()
    yield srv
    srv.stop()


@pytest.fixture
def engine(server: Server) -> Iterator[RemoteEngine]:
    eng = RemoteEngine(RemoteConfig(url=server.url, probe_period=0), SpecConfig(mode="off"))
    yield eng
    eng.close()


def generated(engine: RemoteEngine, request: GenerationRequest) -> str:
    steps = list(engine.generate(request))
    assert steps[-1].finish_reason == "stop", steps[-1]
    return "".join(step.text for step in steps)


@pytest.mark.timeout(180)
def test_llama_server_output_follows_the_json_schema(engine: RemoteEngine) -> None:
    assert engine.kind == KIND_LLAMA_SERVER
    for prompt in ("A robot part as JSON:\n", "Inventory record: "):
        text = generated(engine, GenerationRequest(prompt, max_tokens=96, json_schema=json.dumps(SCHEMA)))
        validate(json.loads(text), SCHEMA)


@pytest.mark.timeout(180)
def test_llama_server_output_follows_the_grammar(engine: RemoteEngine) -> None:
    for prompt in ("Is the sky blue? Answer:", "Q: Is 7 an even number?\nA:"):
        text = generated(engine, GenerationRequest(prompt, max_tokens=8, grammar=YES_NO))
        assert text in ("yes", "no"), text
