"""Constrained output: llguidance's grammar engine behind the engine's own small interface.

A request may carry a GBNF grammar (llama.cpp's format, start rule ``root``, turned into Lark by
:mod:`.gbnf`) or a JSON Schema (llguidance's own compiler). llguidance (the Rust engine llama.cpp,
vLLM and SGLang use) is an Earley parser over a lexer whose work per token is bounded
(:data:`PARSER_LIMITS`): a grammar that needs more than that at some token ends the request with the
reason, and no grammar can make one call run for minutes or recurse the process to death.

Three stages, each where it costs least:

1. :func:`compiled_constraint`, in the goal callback and the parameter callback: the size, the GBNF's
   shape (:mod:`.gbnf`), the conversion and llguidance's own check, all without the model's
   vocabulary. ~5 ms for the planner schema, ~0.1-0.3 s for the worst 64 KiB grammar; cached by
   text, so that a goal's constraint (and a planner's schema sent again with every goal) is
   compiled once.
2. :class:`GrammarVocab`, once per engine, by the generation thread at its first constrained
   request: llguidance's tokenizer over the model's token bytes (~2-4 s for 262,144 tokens),
   calling llama.cpp's own ``llama_tokenize`` to spell forced text as the model does.
3. :class:`Grammar`, per request: llguidance's matcher. Measured with Gemma's 262,144-token
   vocabulary on the planner schema: a whole-vocabulary mask ~0.1 ms (the slowest ~5 ms),
   consuming a token ~10 us, the forced tokens ~0.05 ms.

Every verify row is sampled from its masked row (the engine's ``sampling.sample_constrained``),
with the mask the step computed as it planned the draft (:meth:`Grammar.row_masks`, one per row,
none where the grammar allows the draft's token alone): with a mask this cheap there is nothing to
gain from sampling first and masking only on a refusal, except for greedy rows, where the argmax is
looked up in the mask before the row is copied.

JSON layout (:data:`JSON_OPTIONS`): no free whitespace, and the separators ``", "`` and ``": "``
(``json.dumps``'s layout). Every byte between two values is then forced: the grammar drafts it for
free, and a model cannot spend its max_tokens on whitespace. ``oneOf`` is taken as ``anyOf``, as
llama-cpp-python's converter did (a text that matches two branches is allowed).
"""
from __future__ import annotations

import ctypes
import functools
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .gbnf import GbnfError, gbnf_to_lark
from ..errors import GrammarError
from ..sampling import allowed_tokens, token_allowed

#: A grammar or schema larger than this is refused (the node's ``limits.max_grammar_bytes`` may
#: lower it): llguidance's compiler recurses per nested rule, see :data:`COMPILE_STACK_BYTES`.
MAX_GRAMMAR_BYTES = 1 << 16
#: llguidance's JSON Schema options (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "coerce_one_of": True}
#: llguidance's bounds on one grammar (llguidance's defaults in brackets). Earley items per token
#: (50,000): llama.cpp's JSON grammar needs ~1,000 at its busiest token, the planner schema fewer,
#: while an ambiguous grammar reaches any bound; the time to reach it grows with the grammar's size,
#: hence the bound on symbols (500,000): the planner schema has ~200, a 60-property schema ~330.
#: Measured worst per token within these bounds (64 KiB grammars written to be slow): ~0.1-0.3 s.
PARSER_LIMITS = {"step_max_items": 5000, "max_grammar_size": 10_000, "verbose_errors": False}
#: Stack of the thread llguidance compiles a grammar on: its compiler recurses once per nested
#: rule (~3 KB a level, measured), and a 64 KiB grammar nests ~3,800 levels; a thread's default
#: 8 MiB overflows (a segmentation fault) near 2,600.
COMPILE_STACK_BYTES = 64 << 20
#: Characters of llguidance's error message quoted in a refusal.
MAX_REASON_CHARS = 400

_T = TypeVar("_T")
_STACK_LOCK = threading.Lock()


def _llguidance():  # noqa: ANN202  imported lazily: unconstrained requests do not need it
    try:
        import llguidance  # noqa: WPS433
    except ImportError:
        raise ValueError("constrained output (grammar / json_schema) needs the llguidance package: "
                         "pip install llguidance==1.9.1") from None
    return llguidance


def _parser_limits() -> object:
    """:data:`PARSER_LIMITS` as llguidance's ``LLParserLimits``."""
    return _llguidance().LLParserLimits(**PARSER_LIMITS)


def _on_big_stack(call: Callable[[], _T]) -> _T:
    """``call()`` run in a thread with a :data:`COMPILE_STACK_BYTES` stack (the caller waits)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001  raised again in the caller
            outcome["error"] = exc

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it for this thread alone
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="gemma_spec_grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _reason(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + " ..."


# -- 1. the constraint, checked without the model -------------------------------------------------
@dataclass(frozen=True)
class Constraint:
    """A request's constraint as llguidance's grammar, checked by :func:`compiled_constraint`."""

    source: str  # "grammar" (GBNF), "json_schema" or "tools" (a chat turn's tools, in Lark)
    grammar: str  # llguidance's grammar text (its JSON form)


def compiled_constraint(grammar: str = "", json_schema: str = "", max_bytes: int = MAX_GRAMMAR_BYTES,
                        lark: str = "") -> Optional[Constraint]:
    """The request's constraint (None without one): its GBNF ``grammar``, its ``json_schema``, or
    (a chat turn's tools, chat/syntax.py) a ``lark`` grammar; ValueError with a user-facing reason.
    Cached by text: a planner's schema, or an agent's tools, sent with every goal compile once.

    >>> compiled_constraint(grammar='root ::= "yes" | "no"').source
    'grammar'
    >>> compiled_constraint(json_schema='{"type": "strin"}')
    Traceback (most recent call last):
    ...
    ValueError: json_schema does not compile: Invalid type: strin
    """
    if grammar and json_schema:
        raise ValueError("grammar and json_schema are both set: give at most one of the two")
    if lark and (grammar or json_schema):
        raise ValueError("a tools grammar comes alone, without grammar / json_schema")
    limit = min(max_bytes, MAX_GRAMMAR_BYTES)
    for name, text in (("grammar", grammar), ("json_schema", json_schema)):
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise ValueError(f"{name} is {size} bytes, more than the limit of {limit} "
                             f"(limits.max_grammar_bytes, at most {MAX_GRAMMAR_BYTES})")
    source, text = (("tools", lark) if lark else ("json_schema", json_schema) if json_schema
                    else ("grammar", grammar))
    return _compiled(source, text) if text else None


#: What a constraint that does not compile is refused as, by its source.
_REFUSED = {"grammar": "grammar does not compile", "json_schema": "json_schema does not compile",
            "tools": "the tools' parameters do not compile to a grammar"}


@functools.lru_cache(maxsize=32)
def _compiled(source: str, text: str) -> Constraint:
    """The checked grammar of one constraint text (a failure is not cached: it raises)."""
    matcher = _llguidance().LLMatcher
    if source == "json_schema":
        grammar = matcher.grammar_from_json_schema(_schema_text(text), overrides=JSON_OPTIONS)
    elif source == "tools":
        grammar = matcher.grammar_from_lark(text)
    else:
        try:
            grammar = matcher.grammar_from_lark(gbnf_to_lark(text))
        except GbnfError as exc:
            raise ValueError(f"grammar does not parse: {exc}") from None
    is_error, messages = _on_big_stack(
        lambda: matcher.validate_grammar_with_warnings(grammar, None, limits=_parser_limits()))
    if is_error:
        raise ValueError(f"{_REFUSED[source]}: {_reason(messages[0] if messages else '?')}")
    return Constraint(source, grammar)


def _schema_text(text: str) -> str:
    """The schema as llguidance takes it (an object); ValueError for text that is not one."""
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"json_schema is not valid JSON: {_reason(str(exc))}") from None
    if schema is True:
        return "{}"
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object (a schema), not {json.dumps(schema)[:40]}")
    return text


# -- 2. the model's vocabulary, as llguidance sees it ---------------------------------------------
class GrammarVocab:
    """llguidance's tokenizer of one model: each token's bytes (control tokens marked, so that no
    text can spell them), its end-of-generation tokens, and llama.cpp's ``llama_tokenize`` for
    the text a grammar forces. Valid while the model is loaded: the engine drops it before freeing
    the model."""

    def __init__(self, tokenizer: object, n_vocab: int, eog_tokens: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.eog_tokens = tuple(eog_tokens)

    @classmethod
    def of(cls, backend: object) -> "GrammarVocab":
        """The tokenizer of a :class:`~.backend.LlamaModel` (~2-4 s for 262,144 tokens)."""
        import llama_cpp  # noqa: WPS433

        vocab = backend.handles_vocab
        pieces, eog = _token_pieces(llama_cpp, vocab, backend.n_vocab, backend.is_eog)
        address = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        tokenizer = _llguidance().LLTokenizer.from_llamacpp(
            tokens=pieces, vocab_ptr=vocab, tokenize_fptr=address, eos_token=eog or [backend.eos])
        return cls(tokenizer, backend.n_vocab, eog)

    def start(self, constraint: Constraint) -> "Grammar":
        """A fresh grammar state; GrammarError if llguidance cannot build it for this vocabulary."""
        llguidance = _llguidance()
        started = time.perf_counter()
        matcher = _on_big_stack(lambda: llguidance.LLMatcher(self.tokenizer, constraint.grammar,
                                                             log_level=0, limits=_parser_limits()))
        if matcher.is_error():
            raise GrammarError(f"{constraint.source} does not compile for this model: "
                               f"{_reason(matcher.get_error())}")
        grammar = Grammar(self, matcher)
        grammar.seconds = time.perf_counter() - started
        return grammar


def _token_pieces(llama_cpp: object, vocab: object, n_vocab: int,
                  is_eog: Callable[[int], bool]) -> Tuple[List[bytes], List[int]]:
    """Each token's bytes as llguidance takes them (control tokens and ``<...>`` user-defined ones
    prefixed with 0xFF, which no UTF-8 text contains), and the end-of-generation tokens."""
    special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    to_piece, get_attr = llama_cpp.llama_token_to_piece, llama_cpp.llama_vocab_get_attr
    size = 256
    buf = ctypes.create_string_buffer(size)
    pieces, eog = [], []
    for token in range(n_vocab):
        n = to_piece(vocab, token, buf, size, 0, True)
        if n < 0:  # longer than the buffer
            size = -n
            buf = ctypes.create_string_buffer(size)
            n = to_piece(vocab, token, buf, size, 0, True)
        piece = buf.raw[:n]
        attr = get_attr(vocab, token)
        if attr & special and (attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
                               or (piece.startswith(b"<") and piece.endswith(b">"))):
            piece = b"\xff" + piece
            if is_eog(token):
                eog.append(token)
        pieces.append(piece)
    return pieces, eog


# -- 3. one request's grammar state -------------------------------------------------------------
class AllowedTokens:
    """The tokens a grammar allows next, as llguidance's bitmask (bit t of word t // 32)."""

    def __init__(self, bits: np.ndarray, n_vocab: int) -> None:
        self._bits = bits
        self._n_vocab = n_vocab

    def __contains__(self, token: int) -> bool:
        return token_allowed(self._bits, token)

    @property
    def bits(self) -> np.ndarray:
        """The bitmask itself (the grammar's buffer: copy it to keep it past the next mask)."""
        return self._bits

    def dense(self) -> np.ndarray:
        """A boolean array over the vocabulary."""
        return allowed_tokens(self._bits, self._n_vocab)

    def only(self, token: int) -> bool:
        """Whether ``token`` is the one token allowed."""
        words = self._bits.view(np.uint32)
        return int(words[token >> 5]) == 1 << (token & 31) and np.count_nonzero(words) == 1


class Grammar:
    """One request's grammar state: an llguidance matcher over the tokens emitted so far."""

    def __init__(self, vocab: GrammarVocab, matcher: object) -> None:
        self._vocab = vocab
        self._matcher = matcher
        self._bits = np.zeros((vocab.n_vocab + 31) // 32, dtype=np.int32)
        self.masks = 0  # whole-vocabulary masks computed
        self.seconds = 0.0  # time in llguidance

    def _checked(self, what: str, started: float) -> None:
        self.seconds += time.perf_counter() - started
        if self._matcher.is_error():
            raise GrammarError(f"the grammar stopped the request ({what}): "
                               f"{_reason(self._matcher.get_error())}")

    def allowed(self) -> AllowedTokens:
        """The tokens that may come next (an end-of-generation token: where the text is complete).
        The result is valid until the state changes."""
        started = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self.masks += 1
        self._checked("mask", started)
        return AllowedTokens(self._bits, self._vocab.n_vocab)

    def accept(self, token: int) -> None:
        """Move on by ``token``, which :meth:`allowed` allowed."""
        started = time.perf_counter()
        if not self._matcher.consume_token(token):
            self.seconds += time.perf_counter() - started
            raise GrammarError(f"the grammar refused token {token}: "
                               f"{_reason(self._matcher.get_error()) or 'not allowed here'}")
        self._checked("accept", started)

    def advance(self, tokens: Sequence[int]) -> None:
        """Move on by ``tokens``, each of which the grammar allows (a pass's emitted tokens);
        :meth:`rollback` goes back."""
        for token in tokens:
            self.accept(token)

    def rollback(self, n_tokens: int) -> None:
        """Undo the last ``n_tokens`` :meth:`accept` / :meth:`advance` moved on by."""
        if n_tokens > 0:
            started = time.perf_counter()
            self._matcher.rollback(n_tokens)
            self._checked("rollback", started)

    def row_masks(self, draft: Sequence[int]) -> List[Optional[np.ndarray]]:
        """The masks of a verify pass over ``[pending] + draft`` (a draft the grammar allows, from
        the state after the pending token): row i's is what the grammar allows after ``draft[:i]``
        (a copy of the bitmask, 32 KiB for 262,144 tokens), and None where it allows ``draft[i]``
        alone: any sample of that row under the grammar is that token, so the row needs no logits
        nor a mask. The last row (the bonus token's) always has one. The state is left as it was."""
        masks: List[Optional[np.ndarray]] = []
        moved = 0
        try:
            for token in draft:
                allowed = self.allowed()
                masks.append(None if allowed.only(token) else allowed.bits.copy())
                self.accept(token)
                moved += 1
            masks.append(self.allowed().bits.copy())
        finally:
            self.rollback(moved)
        return masks

    def forced_tokens(self, limit: int) -> List[int]:
        """The tokens the grammar forces from here (keys, punctuation, the rest of an enum value),
        at most ``limit``, spelled as llama.cpp tokenizes that text."""
        if limit <= 0:
            return []
        started = time.perf_counter()
        tokens = self._matcher.compute_ff_tokens()
        self._checked("forced tokens", started)
        return list(tokens[:limit])

    def allowed_after(self, forced: Sequence[int], tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows one after the other once ``forced`` (text
        it forces from here: :meth:`forced_tokens`) is written, before any end-of-generation token
        (a draft is cut there: the row after an accepted end would be sampled under a grammar that
        has stopped). The state is not moved."""
        eog = self._vocab.eog_tokens
        tokens = list(tokens)
        for i, token in enumerate(tokens):
            if token in eog:
                tokens = tokens[:i]
                break
        if not tokens:
            return 0
        started = time.perf_counter()
        n = self._matcher.validate_tokens(list(forced) + tokens)
        self._checked("draft check", started)
        return max(0, int(n) - len(forced))

    def complete(self) -> bool:
        """Whether the text so far is a whole match (the grammar allows ending here)."""
        return bool(self._matcher.is_accepting())

    def close(self) -> None:
        """Drop the matcher (it refers to the vocabulary's tokenizer)."""
        self._matcher = None


__all__ = ["GrammarError", "GrammarVocab", "Grammar", "Constraint", "compiled_constraint",
           "AllowedTokens", "MAX_GRAMMAR_BYTES", "JSON_OPTIONS",
           "PARSER_LIMITS"]
