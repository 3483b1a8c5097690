"""Constrained output: llama.cpp's own grammar engine, driven through its C API.

A request may carry a GBNF grammar (llama.cpp's format, start rule ``root``) or a JSON Schema, which
llama-cpp-python's converter (``llama_cpp.llama_grammar.json_schema_to_gbnf``) turns into GBNF. The
grammar state is a llama.cpp grammar sampler (``llama_sampler_init_grammar``); this module asks it
three things: may this token come next (``apply`` over one candidate), mask a whole row (``apply``
over the vocabulary), and move on by one token (``accept``). There is no grammar engine of our own.

Costs measured on this CPU with Gemma's 262,144-token vocabulary: masking a whole row ~80 ms (the
grammar decodes every token's text), checking one token ~17 us, cloning a state ~13 us. Hence the
rule every row is sampled with (:func:`sample_constrained`, llama.cpp's server does the same):
sample the row as if unconstrained, keep the token if the grammar allows it, and only if it refuses
mask the row and sample again. For greedy requests that is exactly the argmax of the masked row.

Two things llama.cpp would turn into a process abort (``GGML_ABORT``) or a C++ exception across the C
boundary: accepting a token the grammar refuses, and accepting an end-of-generation token before the
grammar is complete. :meth:`Grammar.accept` therefore only ever sees tokens :meth:`Grammar.allows`
passed, and never an end-of-generation token.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import tempfile
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .types import EngineError

ROOT_RULE = "root"
#: A grammar larger than this is refused (the node's ``limits.max_grammar_bytes`` may lower it).
MAX_GRAMMAR_BYTES = 1 << 20
#: One grammar operation (a check, a mask, an accept) slower than this ends the request with an
#: error: an ambiguous grammar's state can grow without bound, and llama.cpp cannot be interrupted.
#: (A whole-row mask of the planner's plan schema takes 0.03-0.3 s on this CPU.)
DEFAULT_SECONDS_PER_TOKEN = 10.0
#: Samples of the vocabulary a whole-row mask checks first, to predict what the row will cost (see
#: Grammar.mask), with the factor of the bound each may predict: a small one that stops only a
#: clear explosion (one long token can dominate 16), then one large enough to be a fair estimate.
MASK_PROBES = ((16, 20.0), (128, 1.0))
#: Times a probe is timed before its prediction refuses a row (the fastest counts): a grammar whose
#: state exploded is slow at every try, a burst of load on the host is not. One ~0.1 s stall in a
#: 128-token probe predicts ~200 s for 262k tokens and ended a request in a CI run (session 27).
PROBE_TRIES = 3
#: Calls over fewer candidates run unchecked (a character probe of ~100, a first argmax tier of 64).
BOUNDED_FROM = 256
#: Characters of forced text looked at per drafted token (JSON's keys and punctuation run ~3-4).
FORCED_CHARS_PER_TOKEN = 8
#: Candidates a greedy row's masked argmax is looked for among (the best 64, then the best 2,048)
#: before the whole row is masked.
ARGMAX_CANDIDATES = (64, 2048)

# llama_token_data as numpy sees it: id (int32), logit (float), p (float)
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
_CAPTURE_LOCK = threading.Lock()


DEAD_END = ("the grammar admits no token here: the text so far cannot be continued (a grammar with a "
            "dead end, or a character no token of the model's vocabulary can spell)")


class GrammarError(EngineError):
    """A grammar stopped the request: it admits no token here, or its state grew too costly."""


def _llama():  # noqa: ANN202  imported lazily, as in backend.py
    import llama_cpp  # noqa: WPS433

    return llama_cpp


def gbnf_of(grammar: str = "", json_schema: str = "", max_bytes: int = MAX_GRAMMAR_BYTES) -> str:
    """The GBNF text of a request's constraint ('' for none); ValueError with a user-facing reason.

    >>> gbnf_of(grammar='root ::= "yes" | "no"')
    'root ::= "yes" | "no"'
    >>> gbnf_of(json_schema='{"type": "boolean"}').splitlines()[0]
    'boolean ::= ("true" | "false") space'
    """
    if grammar and json_schema:
        raise ValueError("grammar and json_schema are both set: give at most one of the two")
    for name, text in (("grammar", grammar), ("json_schema", json_schema)):
        size = len(text.encode("utf-8"))
        if size > max_bytes:
            raise ValueError(f"{name} is {size} bytes, more than the limit of {max_bytes} "
                             "(limits.max_grammar_bytes)")
    if grammar:
        return grammar
    if not json_schema:
        return ""
    try:
        schema = json.loads(json_schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a schema), not {type(schema).__name__}")
    from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: WPS433

    try:
        return json_schema_to_gbnf(json_schema)
    except Exception as exc:  # noqa: BLE001  the converter raises bare ValueError/KeyError/...
        raise ValueError(f"json_schema cannot be turned into a grammar (llama-cpp-python's "
                         f"converter): {type(exc).__name__}: {exc}") from None


def _captured_stderr(call: Callable[[], object]) -> Tuple[object, str]:
    """Run ``call`` with file descriptor 2 sent to a temporary file; (its result, what it wrote).

    llama.cpp reports why a grammar does not parse only with ``fprintf(stderr)`` and its log (which
    backend.py sends to fd 2), and returns NULL. What other threads write in that short window is
    written back to the real stderr afterwards."""
    with _CAPTURE_LOCK, tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            try:
                result = call()
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        sink.seek(0)
        text = sink.read().decode("utf-8", "replace")
    return result, text


def _parse_reason(stderr_text: str) -> str:
    """The first line of what llama.cpp said about a grammar (its parser repeats the whole text)."""
    for line in stderr_text.splitlines():
        line = line.strip()
        if line:
            return line.replace("parse: error parsing grammar: ", "")
    return "llama.cpp refused the grammar"


class GrammarVocab:
    """What grammars of one model share: the vocabulary pointer, its size, its end-of-generation
    test, and the single-character tokens used to find text the grammar forces."""

    def __init__(self, vocab: object, n_vocab: int, is_eog: Callable[[int], bool],
                 token_bytes: Callable[[int], bytes], tokenize: Callable[[str], List[int]]) -> None:
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.is_eog = is_eog
        self.tokenize = tokenize
        self.token_bytes = token_bytes
        self._chars: Optional[Tuple[np.ndarray, List[str]]] = None
        self.eog_tokens = [t for t in range(min(n_vocab, 4096)) if is_eog(t)]

    @classmethod
    def of(cls, backend: object) -> "GrammarVocab":
        """The grammar vocabulary of a :class:`~.backend.LlamaBackend`."""
        vocab = backend.handles_vocab
        buf = ctypes.create_string_buffer(64)  # its own: the generation thread uses the backend's

        def token_bytes(token: int) -> bytes:
            n = _llama().llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
            return buf.raw[:n] if n >= 0 else b"?" * -n  # only the length of a long piece matters

        return cls(vocab, backend.n_vocab, backend.is_eog, token_bytes,
                   lambda text: backend.tokenize(text, add_special=False, parse_special=False))

    def char_tokens(self) -> Tuple[np.ndarray, List[str]]:
        """(ids, characters) of the tokens that are one printable ASCII character, tab or newline
        (read once: ~0.3 s for 262k tokens)."""
        if self._chars is None:
            ids, chars = [], []
            for token in range(self.n_vocab):
                piece = self.token_bytes(token)
                if len(piece) == 1 and (32 <= piece[0] < 127 or piece in (b"\n", b"\t")):
                    if not self.is_eog(token) and piece.decode() not in chars:
                        ids.append(token)
                        chars.append(piece.decode())
            self._chars = (np.array(ids, dtype=np.int32), chars)
        return self._chars

    def compile(self, gbnf: str) -> "Grammar":
        """A fresh grammar state; ValueError with llama.cpp's reason if the text does not parse."""
        llama_cpp = _llama()
        if "\0" in gbnf:
            raise ValueError("grammar contains a NUL character")
        sampler, said = _captured_stderr(
            lambda: llama_cpp.llama_sampler_init_grammar(self.vocab, gbnf.encode("utf-8"),
                                                         ROOT_RULE.encode()))
        if not sampler:
            raise ValueError(f"grammar does not parse: {_parse_reason(said)}")
        return Grammar(self, sampler)


class Grammar:
    """One request's grammar state: a llama.cpp grammar sampler (owned; :meth:`close` frees it)."""

    #: Sample a row as if unconstrained and check only that token first (see the module docstring).
    #: False masks every row whole: only for measuring what the check saves (the bench's
    #: ``mask-every-row`` runners); with sampling it also draws other random numbers.
    check_first = True

    def __init__(self, vocab: GrammarVocab, sampler: object,
                 seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN) -> None:
        self._vocab = vocab
        self._sampler = sampler
        self.seconds_per_token = seconds_per_token
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self.masks = 0  # whole-row masks applied (each ~80 ms with a 262k vocabulary)
        self.checks = 0  # single-token checks
        self.seconds = 0.0  # time in llama.cpp's grammar code

    # -- llama.cpp calls ------------------------------------------------------------------------
    def _apply(self, data: np.ndarray) -> None:
        llama_cpp = _llama()
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(llama_cpp.llama_token_data_p), size=len(data), selected=-1,
            sorted=False)
        started = time.perf_counter()
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        self._spent(time.perf_counter() - started, len(data))

    def _spent(self, seconds: float, candidates: int) -> None:
        self.seconds += seconds
        if seconds > self.seconds_per_token:
            raise GrammarError(
                f"the grammar takes {seconds:.1f} s to check {candidates} token(s) (limit "
                f"{self.seconds_per_token:.1f} s): its state grew too large; simplify the grammar "
                "(fewer ambiguous alternatives or nested repetitions)")

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (an end-of-generation token: whether the grammar is
        complete)."""
        one = self._one
        one[0] = (token, 0.0, 0.0)
        self.checks += 1
        self._apply(one)
        return bool(np.isfinite(one["logit"][0]))

    def allowed(self, tokens: np.ndarray) -> np.ndarray:
        """A boolean mask: which of ``tokens`` may come next (one call for all of them, after the
        cost check of :meth:`_apply_bounded`)."""
        data = np.zeros(len(tokens), dtype=_TOKEN_DATA)
        data["id"] = tokens
        self._apply_bounded(data)
        return np.isfinite(data["logit"])

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a whole row with the tokens the grammar refuses at -inf.

        Samples of the vocabulary (:data:`MASK_PROBES`) go first and time the rest: a call into llama.cpp cannot
        be interrupted, and an ambiguous grammar's state can make one row cost minutes (300
        optional characters in a row: 170 s on this CPU), so a row predicted to take longer than
        the bound is refused before it starts (a probe predicting that is timed again, up to
        :data:`PROBE_TRIES` times: a burst of load on the host does not refuse a row)."""
        data = np.empty(len(logits), dtype=_TOKEN_DATA)
        data["id"] = np.arange(len(logits), dtype=np.int32)
        data["logit"] = logits
        data["p"] = 0.0
        self.masks += 1
        self._apply_bounded(data)
        return data["logit"].copy()

    def _apply_bounded(self, data: np.ndarray) -> None:
        """:meth:`_apply` over many candidates, after even samples of them (:data:`MASK_PROBES`;
        token ids are grouped by kind) predicted the whole call to take no longer than the bound."""
        for size, margin in MASK_PROBES:
            if len(data) <= BOUNDED_FROM:
                break
            predicted = math.inf
            for _ in range(PROBE_TRIES):  # again only while it predicts too much (PROBE_TRIES)
                sample = data[::len(data) // size].copy()
                started = time.perf_counter()
                self._apply(sample)
                predicted = min(predicted, (time.perf_counter() - started) * len(data) / len(sample))
                if predicted <= margin * self.seconds_per_token:
                    break
            else:
                self._spent(predicted, len(data))  # raises GrammarError
        self._apply(data)

    def accept(self, token: int) -> None:
        """Move on by ``token``, which :meth:`allows` passed; end-of-generation tokens are skipped
        (the request ends there)."""
        if self._vocab.is_eog(token):
            return
        started = time.perf_counter()
        _llama().llama_sampler_accept(self._sampler, token)
        self._spent(time.perf_counter() - started, 1)

    def clone(self) -> "Grammar":
        """An independent copy of this state (for walking a draft)."""
        copy = Grammar(self._vocab, _llama().llama_sampler_clone(self._sampler), self.seconds_per_token)
        return copy

    def complete(self) -> bool:
        """Whether the text so far is a whole match (the grammar allows ending here)."""
        return any(self.allows(t) for t in self._vocab.eog_tokens[:1])

    def close(self) -> None:
        if self._sampler:
            _llama().llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:  # pragma: no cover - best effort; close() is the rule
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- drafting -------------------------------------------------------------------------------
    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows one after the other (a draft is cut
        before its first refused token, so that it costs no verify row)."""
        if not tokens:
            return 0
        walk = self.clone()
        try:
            for i, token in enumerate(tokens):
                if self._vocab.is_eog(token) or not walk.allows(token):
                    return i
                walk.accept(token)
            return len(tokens)
        finally:
            walk.close()

    def forced_text(self, max_chars: int, previous: str = "") -> str:
        """The text the grammar forces from here, one character at a time: where exactly one
        printable character may come next it is taken; where the choice is only between one
        character and optional whitespace, JSON's usual layout decides (a space after ``:`` and
        ``,``, none elsewhere). Stops where the grammar may end or more characters are possible.

        A draft, not a promise: characters outside printable ASCII are not looked at, and the
        target verifies every drafted token."""
        ids, chars = self._vocab.char_tokens()
        eog = self._vocab.eog_tokens[:1]
        candidates = np.concatenate([ids, np.array(eog, dtype=np.int32)])  # + end: may it end here?
        walk = self.clone()
        text = ""
        try:
            while len(text) < max_chars:
                allowed = walk.allowed(candidates)
                if eog and allowed[-1]:
                    break
                choices = [chars[i] for i in np.flatnonzero(allowed[:len(ids)])]
                char = _layout_choice(choices, (previous + text)[-1:])
                if char is None:
                    break
                walk.accept(int(ids[chars.index(char)]))
                text += char
        finally:
            walk.close()
        return text


    def forced_tokens(self, last_token: Optional[int], limit: int) -> Tuple[List[int], "Grammar"]:
        """The tokens of :meth:`forced_text` after ``last_token`` (the text so far ends with it),
        at most ``limit``, as the model's tokenizer spells that text; and the grammar state after
        them (a clone: the caller closes it)."""
        vocab = self._vocab
        previous = "" if last_token is None else vocab.token_bytes(last_token).decode("utf-8", "replace")[-1:]
        text = self.forced_text(FORCED_CHARS_PER_TOKEN * limit, previous)
        tokens = vocab.tokenize(text)[:limit] if text else []
        walk = self.clone()
        kept: List[int] = []
        for token in tokens:
            if vocab.is_eog(token) or not walk.allows(token):
                break
            walk.accept(token)
            kept.append(token)
        return kept, walk

def _layout_choice(choices: List[str], previous: str) -> Optional[str]:
    """The one character to draft among ``choices`` (None: the text is free here).

    >>> _layout_choice(['"'], '{'), _layout_choice([' ', ':'], '"'), _layout_choice([' ', '"'], ':')
    ('"', ':', ' ')
    >>> _layout_choice(['a', 'b'], '"') is None
    True
    """
    if len(choices) == 1:
        return choices[0]
    solid = [c for c in choices if not c.isspace()]
    if len(solid) != 1 or len(choices) - len(solid) > 3:
        return None
    if previous in (":", ",") and " " in choices:
        return " "
    return solid[0]


def sample_constrained(sample: Callable[[np.ndarray], int], row: np.ndarray, grammar: Grammar,
                       greedy: bool = False) -> int:
    """One token of ``row`` under ``grammar``: the unconstrained sample if the grammar allows it,
    else a sample of the masked row (llama.cpp's server rule; for greedy, the masked argmax).

    ``sample`` is the request's sampler bound to its random stream, so that plain decoding and
    every speculative mode draw the same numbers for the same rows. ``greedy``: the masked argmax
    is looked for among the row's best candidates first (:func:`masked_argmax`)."""
    if grammar.check_first:
        token = sample(row)
        if grammar.allows(token):
            return token
        if greedy:
            best = masked_argmax(row, grammar)
            if best is not None:
                return best
    masked = grammar.mask(row)
    if not np.isfinite(masked).any():
        raise GrammarError(DEAD_END)
    return sample(masked)


def masked_argmax(row: np.ndarray, grammar: Grammar) -> Optional[int]:
    """``argmax(grammar.mask(row))`` at a fraction of the cost: the grammar checks the row's best
    :data:`ARGMAX_CANDIDATES` tokens only (~0.1-1 ms instead of a whole row's ~80 ms), best first.

    The first allowed one is the masked argmax if its logit is above every token left out (ties with
    a left-out token, which argmax would break by the lower id, go the long way); None when no
    candidate is allowed or such a tie makes it unsure, for the caller to mask the whole row."""
    n = len(row)
    for k in ARGMAX_CANDIDATES:
        if k >= n:
            return None  # the caller's whole-row mask is the same work
        part = np.argpartition(-row, k - 1)[:k]
        ids = part[np.lexsort((part, -row[part]))]  # best first, ties by lower id (as argmax)
        allowed = grammar.allowed(ids.astype(np.int32))
        if allowed.any():
            first = int(ids[int(np.argmax(allowed))])
            # unsure if it could tie with a token left out (argmax would take the lower id)
            return first if row[first] > row[ids[-1]] else None
    return None


def constrained_distribution(distribution: Callable[[np.ndarray], np.ndarray], row: np.ndarray,
                             grammar: Grammar) -> np.ndarray:
    """The distribution :func:`sample_constrained` draws a token of ``row`` from, densely: the
    tokens of the unconstrained distribution the grammar allows keep their probability, and the
    mass of those it refuses goes to the masked row's distribution (rejection verification)."""
    p = distribution(row)
    support = np.flatnonzero(p)
    refused = support[~grammar.allowed(support.astype(np.int32))]
    mass = float(p[refused].sum())
    if mass <= 0.0:
        return p
    p[refused] = 0.0
    masked = grammar.mask(row)
    if not np.isfinite(masked).any():
        raise GrammarError(DEAD_END)
    return p + mass * distribution(masked)


__all__ = ["GrammarError", "GrammarVocab", "Grammar", "gbnf_of", "sample_constrained",
           "constrained_distribution", "MAX_GRAMMAR_BYTES", "DEFAULT_SECONDS_PER_TOKEN"]
