"""GBNF, llama.cpp's grammar format, turned into the Lark text llguidance compiles.

One scan of the text with a regular expression, then one loop over its tokens with an explicit
stack of open groups: linear in the text's size, no recursion, and bounds a client's grammar cannot
talk its way past: at most :data:`MAX_RULES` rules, groups nested at most :data:`MAX_NESTING` deep
(llguidance's Lark parser recurses per group and refuses ~25), repetition counts up to
:data:`MAX_REPETITIONS`.

The format is llama.cpp's (``grammars/README.md``): rules ``name ::= alternatives``, the start rule
``root``; string literals ``"..."``; character classes ``[a-z]``, ``[^"\\\\]``; any character ``.``;
groups ``( )``; repetitions ``* + ? {m} {m,} {m,n}``; comments ``#``; the escapes ``\\xHH \\uHHHH
\\UHHHHHHHH \\t \\r \\n \\\\ \\" \\[ \\]``. A newline ends a rule except inside a group or after
``::=`` or ``|``.

A rule made of characters alone (it refers only to such rules, and to none that leads back to
itself) becomes a Lark *terminal*, an upper-case name that llguidance's lexer matches as one regular
expression; every other rule stays a Lark rule. llguidance's own converter does the same: a grammar
written character by character would otherwise cost one parser step per byte. Character classes
and ``.`` become regular expressions whose every character is written ``\\x{..}``, so that nothing
inside a class reads as regex syntax.

>>> print(gbnf_to_lark('root ::= answer "."\\nanswer ::= "yes" | "no"'), end="")
%llguidance {}
start: T1_ANSWER "."
T1_ANSWER: "yes" | "no"
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Set, Tuple, Union

ROOT_RULE = "root"
#: Rules one grammar may define (llama.cpp's JSON grammar has 7; a large schema's, a few hundred).
MAX_RULES = 1024
#: Groups nested inside groups, ``((( )))``.
MAX_NESTING = 16
#: The largest count in ``{m,n}`` (llama.cpp refuses above 2,000; llguidance expands none).
MAX_REPETITIONS = 100_000

#: One token of GBNF text. Escapes inside literals and classes are checked when decoded.
_TOKEN = re.compile(r"""
    (?P<space>(?:[ \t]+|\#[^\r\n]*)+)
  | (?P<newline>\r\n?|\n)
  | (?P<literal>"[^"\\]*(?:\\.[^"\\]*)*")
  | (?P<charclass>\[[^\]\\]*(?:\\.[^\]\\]*)*\])
  | (?P<name>[a-zA-Z0-9_-]+)
  | (?P<define>::=)
  | (?P<repeat>\{[ \t\r\n]*[0-9]+[ \t\r\n]*(?:,[ \t\r\n]*[0-9]*[ \t\r\n]*)?\})
  | (?P<op>[()|*+?.])
""", re.VERBOSE | re.DOTALL)
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([trn\\\"\[\]]))")
_CHAR = r"(?:\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[trn\\\"\[\]])|[^\\])"
_CLASS_ITEM = re.compile(f"({_CHAR})(?:-({_CHAR}))?", re.DOTALL)
_SIMPLE_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_REPEAT_OPS = {"*": (0, None), "+": (1, None), "?": (0, 1)}
_LARK_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class GbnfError(ValueError):
    """The text is not a GBNF grammar this converter takes; the message says where and why."""


class _Ref:
    """A reference to a rule in a rule's Lark text, named once every rule is known."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


Piece = Union[str, _Ref]


class _Rule:
    """One rule while it is read: its Lark pieces and the rules it refers to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pieces: List[Piece] = []
        self.refs: Set[str] = set()


class _Converter:
    """The loop over the tokens. ``item`` is where the last item of the sequence being read starts
    in ``rule.pieces`` (None: the sequence is empty so far)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.rules: Dict[str, _Rule] = {}

    def error(self, pos: int, reason: str) -> GbnfError:
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return GbnfError(f"{reason} at line {line}, column {column}: {self.text[pos:pos + 24]!r}")

    def tokens(self) -> Iterator[Tuple[str, str, int]]:
        pos = 0
        for match in _TOKEN.finditer(self.text):
            if match.start() != pos:
                break
            pos = match.end()
            if match.lastgroup != "space":
                yield match.lastgroup or "", match.group(0), match.start()
        if pos != len(self.text):
            raise self.error(pos, "unexpected character")

    def convert(self) -> Dict[str, _Rule]:
        rule: Optional[_Rule] = None
        expect = "name"  # name | define | items
        after_newline_ok = False  # a newline here does not end the rule (after ::= or |)
        item: Optional[int] = None
        repeated = False  # the last item already has a repetition
        groups: List[Tuple[int, int]] = []  # per open group: (where it starts in pieces, offset)
        for kind, text, pos in self.tokens():
            if kind == "newline":
                if rule is not None and expect == "items" and not groups and not after_newline_ok:
                    self.end_sequence(rule, item)
                    rule, expect = None, "name"
                continue
            if expect == "name":
                if kind != "name":
                    raise self.error(pos, "expected a rule name")
                rule, expect = self.start_rule(text, pos), "define"
                continue
            if expect == "define":
                if kind != "define":
                    raise self.error(pos, "expected '::='")
                expect, after_newline_ok, item, repeated = "items", True, None, False
                continue
            assert rule is not None
            after_newline_ok = False
            if kind == "repeat" or (kind == "op" and text in _REPEAT_OPS):
                if item is None:
                    raise self.error(pos, f"{text!r} repeats nothing")
                if repeated:  # a repetition of a repetition repeats a group of it
                    rule.pieces.insert(item, "(")
                    rule.pieces.append(")")
                rule.pieces.append(self.repetition(kind, text, pos))
                repeated = True
            elif kind == "op" and text == "|":
                self.end_sequence(rule, item)
                rule.pieces.append(" |")
                item, repeated, after_newline_ok = None, False, True
            elif kind == "op" and text == "(":
                if len(groups) >= MAX_NESTING:
                    raise self.error(pos, f"groups nested more than {MAX_NESTING} deep")
                groups.append((len(rule.pieces), pos))
                rule.pieces.append(" (")
                item, repeated, after_newline_ok = None, False, True
            elif kind == "op" and text == ")":
                if not groups:
                    raise self.error(pos, "')' closes no group")
                self.end_sequence(rule, item)
                item = groups.pop()[0]
                rule.pieces.append(")")
                repeated = False
            else:
                item, repeated = len(rule.pieces), False
                rule.pieces.append(" ")
                rule.pieces.append(self.atom(rule, kind, text, pos))
        if groups:
            raise self.error(groups[-1][1], "'(' is never closed")
        if expect == "define":
            raise GbnfError("the grammar ends before '::='")
        if rule is not None:
            self.end_sequence(rule, item)
        return self.rules

    def start_rule(self, name: str, pos: int) -> _Rule:
        if name in self.rules:
            raise self.error(pos, f"rule {name!r} is defined twice")
        if len(self.rules) >= MAX_RULES:
            raise self.error(pos, f"more than {MAX_RULES} rules")
        rule = self.rules[name] = _Rule(name)
        return rule

    @staticmethod
    def end_sequence(rule: _Rule, item: Optional[int]) -> None:
        """An empty sequence (``x ::= | "a"``) is Lark's ``""``."""
        if item is None:
            rule.pieces.append(' ""')

    def atom(self, rule: _Rule, kind: str, text: str, pos: int) -> Piece:
        if kind == "name":
            rule.refs.add(text)
            return _Ref(text)
        if kind == "literal":
            return _lark_string(self.decode(text[1:-1], pos + 1))
        if kind == "charclass":
            return self.char_class(text, pos)
        if kind == "op" and text == ".":
            return "/(?s:.)/"
        raise self.error(pos, "unexpected token")

    def repetition(self, kind: str, text: str, pos: int) -> str:
        if kind == "op":
            return text
        low_text, _, high_text = text[1:-1].partition(",")
        low = self.count(low_text, pos)
        if "," not in text:
            return f"{{{low}}}" if low != 1 else ""
        if not high_text.strip():
            return f"{{{low},}}"
        high = self.count(high_text, pos)
        if high < low:
            raise self.error(pos, f"repetition {{{low},{high}}}: the maximum is below the minimum")
        return f"{{{low},{high}}}"

    def count(self, digits: str, pos: int) -> int:
        digits = digits.strip()
        if len(digits) > 9 or int(digits) > MAX_REPETITIONS:
            raise self.error(pos, f"a repetition count above {MAX_REPETITIONS}")
        return int(digits)

    def decode(self, text: str, pos: int) -> str:
        """The characters of a literal (or one class character), escapes decoded."""
        if "\\" not in text:
            return text
        out, last = [], 0
        for backslash in re.finditer(r"\\", text):
            if backslash.start() < last:
                continue  # the second backslash of an escaped one
            escape = _ESCAPE.match(text, backslash.start())
            if escape is None:
                raise self.error(pos + backslash.start(), "unknown or incomplete escape")
            out.append(text[last:escape.start()])
            out.append(self.escaped(escape, pos + escape.start()))
            last = escape.end()
        out.append(text[last:])
        return "".join(out)

    def escaped(self, escape: "re.Match[str]", pos: int) -> str:
        x, u, big_u, simple = escape.groups()
        if simple:
            return _SIMPLE_ESCAPES[simple]
        code = int(x or u or big_u, 16)
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise self.error(pos, "not a Unicode character")
        return chr(code)

    def char_class(self, text: str, pos: int) -> str:
        body = text[1:-1]
        negated = body.startswith("^")
        start = pos + 1 + negated
        body = body[negated:]
        parts, at = [], 0
        while at < len(body):
            item = _CLASS_ITEM.match(body, at)
            if item is None:
                raise self.error(start + at, "unknown or incomplete escape")
            low = ord(self.decode(item.group(1), start + at))
            if item.group(2) is None:
                parts.append(f"\\x{{{low:x}}}")
            else:
                high = ord(self.decode(item.group(2), start + at))
                if high < low:
                    raise self.error(start + at, "a character range whose end is below its start")
                parts.append(f"\\x{{{low:x}}}-\\x{{{high:x}}}")
            at = item.end()
        if not parts:
            if negated:
                return "/(?s:.)/"
            raise self.error(pos, "an empty character class matches nothing")
        return f"/[{'^' if negated else ''}{''.join(parts)}]/"


def _lark_string(text: str) -> str:
    """A Lark string literal of ``text``: quotes, backslashes and control characters escaped."""
    out = []
    for char in text:
        escaped = _LARK_ESCAPES.get(char)
        if escaped is None and (char < " " or char == "\x7f"):
            escaped = f"\\u{ord(char):04x}"
        out.append(escaped or char)
    return '"' + "".join(out) + '"'


def terminal_rules(refs: Dict[str, Set[str]]) -> Set[str]:
    """The rules made of characters alone: each rule they refer to is one too, none leads back to
    itself, and the start rule never is. Linear: a rule waits on the rules it refers to.

    >>> sorted(terminal_rules({"root": {"a"}, "a": {"b"}, "b": set(), "c": {"c"}}))
    ['a', 'b']
    """
    waiting = {name: set(names) for name, names in refs.items() if name != ROOT_RULE}
    users: Dict[str, List[str]] = {}
    for name, names in waiting.items():
        for ref in names:
            users.setdefault(ref, []).append(name)
    ready = [name for name, names in waiting.items() if not names]
    terminal: Set[str] = set()
    while ready:
        name = ready.pop()
        terminal.add(name)
        for user in users.get(name, ()):
            waiting[user].discard(name)
            if not waiting[user]:
                ready.append(user)
    return terminal


def _lark_names(rules: List[str], terminal: Set[str]) -> Dict[str, str]:
    """``start`` for the root rule, upper case for terminals, lower case for rules; the index keeps
    apart names that differed only in case or in ``-`` / ``_``."""
    names = {}
    for index, name in enumerate(rules):
        clean = re.sub(r"[^A-Za-z0-9]", "_", name)
        if name == ROOT_RULE:
            names[name] = "start"
        elif name in terminal:
            names[name] = f"T{index}_{clean.upper()}"
        else:
            names[name] = f"r{index}_{clean.lower()}"
    return names


def gbnf_to_lark(text: str) -> str:
    """The Lark text (llguidance's dialect) of a GBNF grammar; GbnfError says where and why not.

    >>> gbnf_to_lark('root ::= "a" | nowhere')
    Traceback (most recent call last):
    ...
    gemma_spec_ros.engine.grammar.gbnf.GbnfError: rule 'nowhere' is used but not defined (in rule 'root')
    """
    rules = _Converter(text).convert()
    if ROOT_RULE not in rules:
        raise GbnfError(f"the grammar has no rule {ROOT_RULE!r} (its start rule)")
    for rule in rules.values():
        missing = sorted(rule.refs - rules.keys())
        if missing:
            raise GbnfError(f"rule {missing[0]!r} is used but not defined (in rule {rule.name!r})")
    names = _lark_names(list(rules), terminal_rules({r.name: r.refs for r in rules.values()}))
    lines = ["%llguidance {}"]
    for rule in rules.values():
        body = "".join(names[p.name] if isinstance(p, _Ref) else p for p in rule.pieces)
        lines.append(f"{names[rule.name]}:{body}")
    return "\n".join(lines) + "\n"
