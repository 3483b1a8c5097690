"""The body of a streamed completion request, per kind of server.

A request without the chat template goes to ``POST /v1/completions`` with its plain prompt; with it,
to ``/v1/chat/completions`` with the messages (the server applies its own template); a chat turn
too, with its conversation's messages and tools (:func:`~.chat.chat_fields`). All stream
(``stream: true``) and ask for the usage in the last chunk.

Constrained output (``GenerationRequest.grammar`` / ``.json_schema``), as each server takes it:

- llama.cpp's ``llama-server``: ``grammar`` (GBNF text) or ``json_schema`` (the schema as a JSON
  object) in the body; it converts the schema to a grammar itself.
- llama-cpp-python's ``llama_cpp.server``: ``grammar`` only; a schema is converted here with
  llama-cpp-python's own converter (``json_schema_to_gbnf``), the one the local engine uses.
- vLLM: ``structured_outputs`` (``{"json": schema}`` or ``{"grammar": text}``), the field of vLLM
  0.10.2 and later; the older ``guided_json`` / ``guided_grammar`` were removed in vLLM 0.12.
- any other server: refused (RemoteError): it would ignore the constraint and return free text.

A schema that is not JSON, or not a JSON object, is a ValueError before anything is sent.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

from ..chat.syntax import CallSyntax
from ..request import GenerationRequest
from .chat import chat_fields
from .http import RemoteError
from .server import KIND_LLAMA_CPP_PYTHON, KIND_LLAMA_SERVER, KIND_VLLM, LLAMA_CPP_KINDS

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


def parse_json_schema(text: str) -> Optional[Dict[str, Any]]:
    """The request's JSON Schema as an object; None for ''. ValueError with the reason otherwise.

    >>> parse_json_schema('{"type": "object"}')
    {'type': 'object'}
    >>> parse_json_schema('{"type": ')
    Traceback (most recent call last):
    ...
    ValueError: json_schema is not valid JSON (Expecting value at line 1, column 10): give a JSON Schema object
    """
    if not text:
        return None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        where = f" at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ValueError(f"json_schema is not valid JSON ({reason}{where}): give a JSON Schema object") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema is JSON but not an object ({type(schema).__name__}): give a "
                         "JSON Schema object, e.g. {\"type\": \"object\", \"properties\": {...}}")
    return schema


def constraint_fields(request: GenerationRequest, kind: str) -> Dict[str, Any]:
    """The body fields that constrain the output on a server of ``kind`` ({} if unconstrained).

    >>> constraint_fields(GenerationRequest("Q", grammar='root ::= "yes" | "no"'), KIND_VLLM)
    {'structured_outputs': {'grammar': 'root ::= "yes" | "no"'}}
    >>> constraint_fields(GenerationRequest("Q", json_schema='{"type": "integer"}'), KIND_LLAMA_SERVER)
    {'json_schema': {'type': 'integer'}}
    """
    schema = parse_json_schema(request.json_schema)
    if schema is None and not request.grammar:
        return {}
    if kind == KIND_LLAMA_SERVER:
        return {"json_schema": schema} if schema is not None else {"grammar": request.grammar}
    if kind == KIND_LLAMA_CPP_PYTHON:
        return {"grammar": request.grammar or _schema_grammar(request.json_schema)}
    if kind == KIND_VLLM:
        return {"structured_outputs": {"json": schema} if schema is not None else {"grammar": request.grammar}}
    raise RemoteError(f"constrained output (grammar / json_schema) needs llama-server, llama_cpp.server "
                      f"or vLLM; this server is {kind or 'not identified'} and would ignore the "
                      "constraint")


def completion_request(request: GenerationRequest, kind: str, model: str,
                       syntax: Optional[CallSyntax] = None) -> Tuple[str, Dict[str, Any]]:
    """(path, body) of the streamed completion for ``request`` on a server of ``kind`` (``syntax``:
    the call syntax of its template, for a chat turn: see :func:`~.chat.chat_fields`).

    >>> completion_request(GenerationRequest("Hi", max_tokens=4), KIND_VLLM, "")[1]["prompt"]
    'Hi'
    """
    sampling = request.sampling
    body: Dict[str, Any] = {
        "max_tokens": request.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "min_p": sampling.min_p, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind in LLAMA_CPP_KINDS:
        # the request's sampler exactly: llama.cpp reads top_k 0 as no limit, and
        # llama_cpp.server would otherwise apply its own defaults (top_k 40, repeat_penalty 1.1)
        body.update(top_k=sampling.top_k, repeat_penalty=1.0)
    elif sampling.top_k > 0:  # vLLM & co spell "no limit" differently: leave it to them
        body["top_k"] = sampling.top_k
    if sampling.seed >= 0:
        body["seed"] = sampling.seed
    if request.stop:
        body["stop"] = list(request.stop)
    if model:
        body["model"] = model
    body.update(constraint_fields(request, kind))
    if request.conversation is not None:
        fields = chat_fields(request.conversation, syntax if kind == KIND_LLAMA_SERVER else None)
        stop = list(body.get("stop", [])) + fields.pop("stop", [])
        body.update(fields)
        if stop:
            body["stop"] = stop
        return CHAT_COMPLETIONS_PATH, body
    if request.use_chat_template:
        messages = [{"role": "user", "content": request.prompt}]
        if request.system_prompt:
            messages.insert(0, {"role": "system", "content": request.system_prompt})
        body["messages"] = messages
        return CHAT_COMPLETIONS_PATH, body
    body["prompt"] = request.plain_prompt
    return COMPLETIONS_PATH, body


def _schema_grammar(schema_text: str) -> str:
    """GBNF for a JSON Schema, by llama-cpp-python's converter (imported only when needed)."""
    try:
        from llama_cpp.llama_grammar import json_schema_to_gbnf
    except ImportError as exc:  # the remote backend runs without llama_cpp otherwise
        raise RemoteError(f"llama_cpp.server takes a GBNF grammar, and converting the json_schema "
                          f"needs llama-cpp-python here ({exc})") from None
    try:
        return json_schema_to_gbnf(schema_text)
    except Exception as exc:  # noqa: BLE001  the converter raises plain exceptions on schemas it lacks
        raise ValueError(f"json_schema cannot be converted to a grammar: {exc}") from None


__all__ = ["CHAT_COMPLETIONS_PATH", "COMPLETIONS_PATH", "completion_request", "constraint_fields",
           "parse_json_schema"]
