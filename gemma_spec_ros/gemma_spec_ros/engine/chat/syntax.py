"""How a model writes tool calls: each syntax's grammar (what the output may be) and its parser.

Two syntaxes, one per family of templates (:func:`syntax_of_template` picks by what the template
writes):

- :data:`GEMMA_CALLS`, Gemma 4's own: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, the
  markers control tokens, strings between two ``<|"|>`` tokens, keys bare and in the order
  Gemma's template sorts them (``dictsort``: case-insensitive), numbers, ``true``, ``false``,
  ``null``, ``[...]`` and ``{...}`` as in JSON. A tool's JSON Schema becomes a grammar of that
  syntax here (:class:`_GemmaArguments`: types, properties and required keys, enum, const,
  anyOf / oneOf, items, string lengths, ``$ref`` into the parameters, recursive ones included);
  other keywords (bounds, patterns) are not in the grammar, so arguments are validated against the
  schema after generation as always.
- :data:`TAGGED_JSON_CALLS`: ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, plain
  text (the syntax of Hermes and Qwen templates, and of this package's fallback for templates
  without tools, which :meth:`TaggedJsonCalls.describe` explains to the model). The arguments go
  through llguidance's JSON Schema compiler (``%json``), with the engine's JSON layout.

Grammars (Lark for llguidance, engine/grammar/matcher.py's engine): with ``tool_choice`` required or a
name, the whole output is calls; with ``auto``, text stays free until the model opens a call (a
*lazy* rule: any text up to the first ``<tool_call>``; Gemma's marker is a token no text can
spell), and from there the call must follow the grammar. ``parallel_tool_calls`` false allows one
call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..grammar.matcher import JSON_OPTIONS

Piece = Tuple[str, bool]  # (text, is a control token)
Call = Tuple[str, Dict[str, Any]]  # (tool name, arguments)
#: A key Gemma's syntax can write bare (its parser splits at ``:{}[],``).
GEMMA_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")
#: Terminals of Gemma's values (regexes of llguidance's Lark: Rust regex syntax).
GEMMA_TERMINALS = r"""
INT: /-?(0|[1-9][0-9]*)/
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/
STR: /(.|\n)+/
KEY: /[A-Za-z_][A-Za-z0-9_]*/
"""


@dataclass(frozen=True)
class Parsed:
    """A reply cut into its text and its calls; ``error``: why a call could not be read (the other
    calls are kept); ``cut``: the reply ends inside a call (the last error says so)."""

    content: str
    calls: Tuple[Call, ...] = ()
    error: str = ""
    cut: bool = False


class CallSyntax:
    """What a syntax provides; see the two below."""

    name = ""
    #: the text that opens a call (a control token's text where ``opens_with_token``)
    opener = ""
    opens_with_token = False

    def grammar(self, tools: Sequence[Any], must_call: bool, parallel: bool,
                control_id: Any = None) -> str:
        """The Lark grammar of a reply that may (or must) call ``tools``."""
        raise NotImplementedError

    def parse(self, pieces: Sequence[Piece]) -> Parsed:
        raise NotImplementedError

    def describe(self, tools: Sequence[Any], parallel: bool) -> str:
        """A system message telling the model the tools and how to call them (fallback only)."""
        raise NotImplementedError(f"the {self.name} syntax is written by its template")

    def describe_result(self, name: str, content: str) -> str:
        raise NotImplementedError(f"the {self.name} syntax is written by its template")

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        raise NotImplementedError(f"the {self.name} syntax is written by its template")


# -- JSON in <tool_call> tags ------------------------------------------------------------------------
class TaggedJsonCalls(CallSyntax):
    """``<tool_call>`` JSON ``</tool_call>`` (see the module docstring).

    >>> s = TAGGED_JSON_CALLS
    >>> s.parse([('On my way. ' + s.write("go", {"to": "dock"}), False)])
    Parsed(content='On my way.', calls=(('go', {'to': 'dock'}),), error='', cut=False)
    """

    name = "tagged JSON"
    opener = "<tool_call>"
    closer = "</tool_call>"

    def write(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the grammar lets the model write it (json.dumps's layout)."""
        body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"{self.opener}\n{body}\n{self.closer}"

    def grammar(self, tools: Sequence[Any], must_call: bool, parallel: bool,
                control_id: Any = None) -> str:
        functions = [f"fn{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]
        body = f'body: "\\n" ({" | ".join(f"fn{i}" for i in range(len(tools)))}) "\\n{self.closer}"'
        if must_call:
            rules = ['start: call ("\\n" call)*' if parallel else "start: call", f'call: "{self.opener}" body']
        else:
            # one call allowed: the turn ends where it closes (text or whitespace after it would run
            # on to max_tokens, and be thrown away by the parser)
            rules = ["start: (opened body)* TEXT"] if parallel else ["start: TEXT | opened body"]
            rules += ["TEXT: /(.|\\n)*/", f'opened[lazy]: TEXT "{self.opener}"']
        return "\n".join(rules + [body] + functions) + "\n"

    def parse(self, pieces: Sequence[Piece]) -> Parsed:
        text = "".join(piece for piece, control in pieces if not control)
        content: List[str] = []
        calls: List[Call] = []
        errors: List[str] = []
        at = 0
        while True:
            start = text.find(self.opener, at)
            if start < 0:
                content.append(text[at:])
                return Parsed(_joined(content), tuple(calls), "; ".join(errors))
            content.append(text[at:start])
            end = text.find(self.closer, start)
            if end < 0:
                errors.append(f"the reply ended inside a tool call (no {self.closer})")
                return Parsed(_joined(content), tuple(calls), "; ".join(errors), cut=True)
            body = text[start + len(self.opener):end].strip()
            try:
                calls.append(_json_call(body))
            except ValueError as exc:
                errors.append(f"a tool call does not parse: {exc}")
            at = end + len(self.closer)

    def describe(self, tools: Sequence[Any], parallel: bool) -> str:
        lines = ["You can call the tools below. Each line is one tool: its name, what it does, and "
                 "the JSON Schema of its arguments."]
        lines += [json.dumps({"name": t.name, "description": t.description,
                              "parameters": dict(t.parameters)}, ensure_ascii=False) for t in tools]
        lines += ["To call a tool, write exactly this and nothing after it:",
                  self.write("<the tool's name>", {}).replace("{}", "{<its arguments as JSON>}")]
        if parallel:
            lines.append("To call several tools, write one such block per call, one after the other.")
        lines.append("If no tool is needed, answer in plain text.")
        return "\n".join(lines)

    def describe_result(self, name: str, content: str) -> str:
        return f'<tool_response name="{name}">\n{content}\n</tool_response>'


def _call_schema(tool: Any) -> Dict[str, Any]:
    """The JSON Schema of one call of ``tool``: ``{"name": its name, "arguments": its parameters}``
    with the engine's JSON layout; the parameters' ``$defs`` / ``definitions`` lifted to the top,
    where their ``#/$defs/...`` references point, every other reference into the parameters
    (``#``, ``#/properties/...``) pointed at them under ``arguments`` (:func:`rebased`), and objects
    closed (:func:`closed`). Validation reads the parameters themselves: both see one schema."""
    parameters = closed(rebased(dict(tool.parameters)))
    lifted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {"x-guidance": dict(JSON_OPTIONS), "type": "object", **lifted,
            "properties": {"name": {"const": tool.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def rebased(schema: Any, at: str = "#/properties/arguments") -> Any:
    """``schema`` with its references into itself made references into the call schema, where it
    sits at ``at``; those into ``$defs`` / ``definitions`` stay (they are lifted to the top).

    >>> rebased({"items": {"$ref": "#"}, "x": {"$ref": "#/$defs/p"}, "y": {"$ref": "#/properties/a"}})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'items': {'$ref': '#/properties/arguments'}, 'x': {'$ref': '#/$defs/p'},
     'y': {'$ref': '#/properties/arguments/properties/a'}}
    """
    if isinstance(schema, list):
        return [rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key in ("const", "enum", "default", "examples") else rebased(value, at))
           for key, value in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) \
            and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = at + ref[1:]
    return out


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` wherever an object lists its properties and
    says nothing of others: the grammar writes the declared keys only (as llama.cpp's converter
    does). Every such reply also follows the schema as given, which validation checks.

    >>> closed({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'type': 'object', 'properties': {'a': {'type': 'object', 'properties': {}, 'additionalProperties': False}},
     'additionalProperties': False}
    """
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) if key != "const" and key != "enum" else value for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_call(body: str) -> Call:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
            or not isinstance(value.get("arguments", {}), dict):
        raise ValueError('expected {"name": "<tool>", "arguments": {...}}')
    return value["name"], value.get("arguments", {})


# -- Gemma 4's native calls ------------------------------------------------------------------------
class GemmaCalls(CallSyntax):
    """Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` (see the module docstring).

    >>> q = ('<|"|>', True)
    >>> GEMMA_CALLS.parse([("Going. ", False), ("<|tool_call>", True), ("call:go{to:", False), q,
    ...                    ("dock", False), q, (",speed:0.5}", False), ("<tool_call|>", True)])
    Parsed(content='Going.', calls=(('go', {'to': 'dock', 'speed': 0.5}),), error='', cut=False)
    """

    name = "Gemma 4"
    opener = "<|tool_call>"
    closer = "<tool_call|>"
    quote = '<|"|>'
    opens_with_token = True

    def grammar(self, tools: Sequence[Any], must_call: bool, parallel: bool,
                control_id: Any = None) -> str:
        ids = {text: control_id(text) if control_id is not None else None
               for text in (self.opener, self.closer, self.quote)}
        missing = [text for text, token in ids.items() if token is None]
        if missing:
            raise ValueError(f"the template writes Gemma 4 tool calls, but the model's vocabulary has "
                             f"no control token {missing[0]!r}")
        opener, closer, quote = (f"<[{ids[t]}]>" for t in (self.opener, self.closer, self.quote))
        rules = _GemmaArguments(quote)
        functions = [f'fn{i}: "call:{tool.name}" {rules.arguments(closed(dict(tool.parameters)))}'
                     for i, tool in enumerate(tools)]
        one = f"{opener} ({' | '.join(f'fn{i}' for i in range(len(tools)))}) {closer}"
        if must_call:
            start = f"start: call{' call*' if parallel else ''}"
        else:
            start = f"start: TEXT{' call*' if parallel else ' call?'}"
        return "\n".join([start, f"call: {one}", "TEXT: /(.|\\n)*/", *functions, *rules.lines,
                          GEMMA_TERMINALS])

    def parse(self, pieces: Sequence[Piece]) -> Parsed:
        content: List[str] = []
        calls: List[Call] = []
        errors: List[str] = []
        i = 0
        while i < len(pieces):
            text, control = pieces[i]
            if control and text == self.opener:
                end = next((j for j in range(i + 1, len(pieces)) if pieces[j] == (self.closer, True)), -1)
                if end < 0:
                    errors.append(f"the reply ended inside a tool call (no {self.closer})")
                    return Parsed(_joined(content), tuple(calls), "; ".join(errors), cut=True)
                try:
                    calls.append(_GemmaReader(pieces[i + 1:end], self.quote).call())
                except ValueError as exc:
                    errors.append(f"a tool call does not parse: {exc}")
                i = end + 1
                continue
            if not control:
                content.append(text)
            i += 1
        return Parsed(_joined(content), tuple(calls), "; ".join(errors))


@dataclass
class _GemmaArguments:
    """Lark rules of Gemma's value syntax for JSON Schemas (see the module docstring)."""

    quote: str  # the ``<|"|>`` token as Lark writes a token: <[id]>
    lines: List[str] = field(default_factory=list)
    _generic: str = ""
    _root: Any = None  # the parameters being written: where their ``$ref``s point
    _refs: Dict[str, str] = field(default_factory=dict)  # a reference -> its rule, for this root
    _named: int = 0

    def _rule(self, body: str) -> str:
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def arguments(self, parameters: Mapping[str, Any]) -> str:
        """The rule of a tool's arguments, ``parameters`` the root its references point into."""
        self._root, self._refs = parameters, {}
        return self.value(parameters)

    def reference(self, ref: str) -> str:
        """The rule of the schema ``ref`` points to in the parameters (a JSON pointer; the goal
        check refused any other): named before its body is written, so a schema may refer to
        itself."""
        from .conversation import json_pointer  # noqa: WPS433

        name = self._refs.get(ref)
        if name is None:
            target = json_pointer(self._root, ref[1:]) if ref.startswith("#") else None
            if not isinstance(target, dict):
                return self.generic()
            self._named += 1
            name = self._refs[ref] = f"r{self._named}"
            self.lines.append(f"{name}: {self.value(target)}")
        return name

    def value(self, schema: Any) -> str:
        """The rule of one value that follows ``schema``."""
        if not isinstance(schema, dict):
            return self.generic() if schema is not False else self._rule('"null"')
        if isinstance(schema.get("$ref"), str):
            return self.reference(schema["$ref"])
        if "const" in schema:
            return self._rule(self.literal(schema["const"]))
        if "enum" in schema:
            return self._rule(" | ".join(self.literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                rest = {k: v for k, v in schema.items() if k != key}
                return self._rule(" | ".join(self.value({**rest, **branch}) if isinstance(branch, dict)
                                             else self.generic() for branch in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._rule(" | ".join(self.value({**schema, "type": k}) for k in kind))
        if kind == "object" or (kind is None and "properties" in schema):
            return self.object(schema)
        if kind == "integer" and _small_range(schema):
            return self._rule(" | ".join(json.dumps(str(v)) for v in
                                         range(int(schema["minimum"]), int(schema["maximum"]) + 1)))
        simple = {"integer": "INT", "number": "NUMBER", "boolean": '("true" | "false")', "null": '"null"'}
        if kind in simple:
            return self._rule(simple[kind])
        if kind == "string":
            return self.string(schema)
        if kind == "array":
            return self.array(schema)
        return self.generic()

    def array(self, schema: Mapping[str, Any]) -> str:
        """``[v,v,...]``, with minItems / maxItems as a bounded repetition."""
        items = self.value(schema.get("items", True))
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) == 0:
            return self._rule('"[" "]"')
        more = f'("," {items}){{{max(low - 1, 0)},{int(high) - 1 if high is not None else ""}}}'
        return self._rule(f'"[" ({items} {more}){"" if low else "?"} "]"')

    def string(self, schema: Mapping[str, Any]) -> str:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        if not low and high is None:
            return self._rule(f"{self.quote} STR? {self.quote}")
        bounds = f"{low},{int(high) if high is not None else ''}"
        return self._rule(f"{self.quote} /(.|\\n){{{bounds}}}/ {self.quote}")

    def object(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties") or {}
        if not properties:
            return self.generic_object() if schema.get("additionalProperties", True) is not False \
                else self._rule('"{" "}"')
        keys = sorted(properties, key=lambda k: k.lower())  # Jinja's dictsort, as templates render
        bad = [k for k in keys if not GEMMA_KEY.match(k)]
        if bad:
            raise ValueError(f"property {bad[0]!r} cannot be written in Gemma 4's call syntax (keys are "
                             f"bare words: {GEMMA_KEY.pattern})")
        required = set(schema.get("required") or ())
        items = [f'"{k}:" {self.value(properties[k])}' for k in keys]
        after = [(f'"," {item}' if k in required else f'("," {item})?') for k, item in zip(keys, items)]
        firsts = []
        for i, key in enumerate(keys):
            firsts.append(" ".join([items[i], *after[i + 1:]]))
            if key in required:
                break
        body = " | ".join(f"({first})" for first in firsts)
        optional = not required
        return self._rule(f'"{{" ({body}){"?" if optional else ""} "}}"')

    def literal(self, value: Any) -> str:
        """A Lark literal of ``value`` written in Gemma's syntax."""
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        return json.dumps(_gemma_text(value))

    def generic(self) -> str:
        """Any value (keywords outside the grammar's subset: validated after generation)."""
        if not self._generic:
            self._generic = "g"
            self.lines += ['g: gs | NUMBER | "true" | "false" | "null" | go | ga',
                           f"gs: {self.quote} STR? {self.quote}",
                           'go: "{" (KEY ":" g ("," KEY ":" g)*)? "}"',
                           'ga: "[" (g ("," g)*)? "]"']
        return self._generic

    def generic_object(self) -> str:
        self.generic()
        return "go"


#: An integer range at most this wide becomes a list of its values in Gemma's grammar.
SMALL_RANGE = 256


def _small_range(schema: Mapping[str, Any]) -> bool:
    low, high = schema.get("minimum"), schema.get("maximum")
    return isinstance(low, (int, float)) and isinstance(high, (int, float)) and 0 <= high - low <= SMALL_RANGE


def _gemma_text(value: Any) -> str:
    """A non-string value as Gemma's template writes it (strings need the quote token)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    raise ValueError(f"a const / enum value {value!r} cannot be written in Gemma 4's call syntax")


class _GemmaReader:
    """A recursive-descent reader of one Gemma call's pieces (between its markers)."""

    WORD = re.compile(r"[{}\[\]:,]|[^{}\[\]:,]+")

    def __init__(self, pieces: Sequence[Piece], quote: str) -> None:
        self.lexemes: List[Tuple[str, Any]] = []
        in_string, buffer = False, []
        for text, control in pieces:
            if control:
                if text != quote:
                    raise ValueError(f"unexpected {text!r} inside a call")
                if in_string:
                    self.lexemes.append(("string", "".join(buffer)))
                    buffer = []
                in_string = not in_string
            elif in_string:
                buffer.append(text)
            else:
                for word in self.WORD.findall(text):
                    if word.strip():
                        self.lexemes.append(("punct" if word in "{}[]:," else "word", word.strip()))
        if in_string:
            raise ValueError("a string is not closed")
        self.at = 0

    def _next(self) -> Tuple[str, Any]:
        if self.at >= len(self.lexemes):
            raise ValueError("the call ends too early")
        self.at += 1
        return self.lexemes[self.at - 1]

    def _expect(self, punct: str) -> None:
        kind, value = self._next()
        if (kind, value) != ("punct", punct):
            raise ValueError(f"expected {punct!r}, found {value!r}")

    def call(self) -> Call:
        kind, word = self._next()
        if (kind, word) != ("word", "call"):
            raise ValueError(f"expected 'call:', found {word!r}")
        self._expect(":")
        kind, name = self._next()
        if kind != "word":
            raise ValueError("a call without a tool name")
        arguments = self.value()
        if not isinstance(arguments, dict) or self.at != len(self.lexemes):
            raise ValueError("a call's arguments must be one {...}")
        return name, arguments

    def value(self) -> Any:
        kind, value = self._next()
        if kind == "string":
            return value
        if kind == "word":
            return _gemma_word(value)
        if value == "{":
            return self._object()
        if value == "[":
            return self._list()
        raise ValueError(f"unexpected {value!r}")

    def _object(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.lexemes[self.at:self.at + 1] == [("punct", "}")]:
            self.at += 1
            return out
        while True:
            kind, key = self._next()
            if kind not in ("word", "string"):
                raise ValueError(f"expected a key, found {key!r}")
            self._expect(":")
            out[key] = self.value()
            kind, punct = self._next()
            if punct == "}":
                return out
            if punct != ",":
                raise ValueError(f"expected ',' or '}}', found {punct!r}")

    def _list(self) -> List[Any]:
        out: List[Any] = []
        if self.lexemes[self.at:self.at + 1] == [("punct", "]")]:
            self.at += 1
            return out
        while True:
            out.append(self.value())
            kind, punct = self._next()
            if punct == "]":
                return out
            if punct != ",":
                raise ValueError(f"expected ',' or ']', found {punct!r}")


def _gemma_word(word: str) -> Any:
    """A bare word: a number, true, false or null (Gemma's template writes None for null)."""
    words = {"true": True, "false": False, "null": None, "None": None, "True": True, "False": False}
    if word in words:
        return words[word]
    try:
        return int(word) if re.fullmatch(r"-?[0-9]+", word) else float(word)
    except ValueError:
        raise ValueError(f"{word!r} is not a value (strings are written between <|\"|> tokens)") from None


def _joined(parts: Sequence[str]) -> str:
    return "".join(parts).strip()


GEMMA_CALLS = GemmaCalls()
TAGGED_JSON_CALLS = TaggedJsonCalls()


def syntax_of_template(source: str) -> Optional[CallSyntax]:
    """The call syntax a template that takes tools writes; None if it is neither (the fallback)."""
    if GemmaCalls.opener in source:
        return GEMMA_CALLS
    if TaggedJsonCalls.opener in source:
        return TAGGED_JSON_CALLS
    return None


__all__ = ["CallSyntax", "GEMMA_CALLS", "Parsed", "TAGGED_JSON_CALLS", "syntax_of_template"]
