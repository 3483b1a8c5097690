"""Where a text spells a vocabulary's special tokens, found as llama.cpp finds them, in linear time.

llama.cpp's tokenizer with special-token parsing (``llama_tokenize(..., parse_special=true)``,
``tokenizer_st_partition``) takes every special token of the vocabulary, longest text first, and
carves each occurrence of its text out of the text fragments not yet carved, left to right. That is
a scan of the text per special token (Gemma's 262,144-token vocabulary has 6,250 control and 165
user-defined ones: 12 s for a tool schema of 60,000 ``<``) and a walk of the fragment list per
occurrence (quadratic in the number of turn markers: a minute for 40,000 empty chat messages).
Both ran in a goal callback. :class:`SpecialTexts` gives the same split with one scan of the text:
occurrences are found by their first two characters, then carved longest first as llama.cpp does.

Kinds of special tokens: *control* and *unknown* ones are parsed only with special-token parsing
(the chat layer's turn markers); *user-defined* ones (Gemma: runs of spaces, newlines, tabs) are
carved even without it and stay text here, but a longer one carved first keeps a control token's
text inside it from being parsed, so those that share a character with a control text take part.

Where llama.cpp's rule cannot be followed here (a special token that strips the whitespace beside
it), :meth:`SpecialTexts.of` returns None and the caller uses llama.cpp's own parsing.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from .process import load_llama_cpp

Part = Union[str, int]  # text, or a control token's id


@dataclass(frozen=True)
class SpecialTexts:
    """A vocabulary's special token texts: those parsed as tokens (``parsed``: text -> id, control
    and unknown ones) and those that only keep a text from being parsed (``blocking``)."""

    parsed: Dict[str, int]
    blocking: FrozenSet[str]

    @classmethod
    def of(cls, model: Any) -> Optional["SpecialTexts"]:
        """The special texts of a loaded model's vocabulary (one llama.cpp call per token, ~0.2 s
        for 262,144 tokens); None where llama.cpp's rule needs its own parsing."""
        llama_cpp = load_llama_cpp()
        vocab = model.handles_vocab
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        strips = llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP | llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
        parsed: Dict[str, int] = {}
        users: List[str] = []
        for token in range(model.n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(vocab, token))
            if not attr & (special | user):
                continue
            if attr & strips:
                return None
            try:
                text = model.token_text(token).decode("utf-8")
            except UnicodeDecodeError:
                return None
            if not text:
                continue
            if attr & special:
                parsed.setdefault(text, token)
            else:
                users.append(text)
        return cls.from_texts(parsed, users)

    @classmethod
    def from_texts(cls, parsed: Dict[str, int], users: Sequence[str]) -> "SpecialTexts":
        """From the texts themselves: control/unknown ``parsed`` (text -> id) and user-defined ones.

        >>> texts = SpecialTexts.from_texts({"<a>": 7, "<ab>": 8}, ["  ", "a>b"])
        >>> sorted(texts.blocking)
        ['a>b']
        """
        chars = set("".join(parsed))
        blocking = frozenset(t for t in users if t not in parsed and chars.intersection(t))
        return cls(dict(parsed), blocking)

    def __post_init__(self) -> None:
        texts = list(self.parsed) + list(self.blocking)
        lengths: Dict[str, set] = {}
        for text in texts:
            lengths.setdefault(text[:2], set()).add(len(text))
        # the lengths to try at a position, by its first two characters (one character for the
        # texts of one character), longest first
        object.__setattr__(self, "_lengths", {k: sorted(v, reverse=True) for k, v in lengths.items()})
        firsts = sorted({text[0] for text in texts})
        object.__setattr__(self, "_starts", re.compile("[" + "".join(re.escape(c) for c in firsts) + "]")
                           if firsts else None)

    def occurrences(self, text: str) -> List[Tuple[int, int]]:
        """Every (start, length) where a special text occurs in ``text`` (overlapping ones too)."""
        found: List[Tuple[int, int]] = []
        starts = self._starts  # type: ignore[attr-defined]
        if starts is None:
            return found
        lengths, parsed, blocking = self._lengths, self.parsed, self.blocking  # type: ignore[attr-defined]
        for match in starts.finditer(text):
            at = match.start()
            for key in (text[at:at + 2], text[at]):
                for length in lengths.get(key, ()):
                    piece = text[at:at + length]
                    if len(piece) == length and (piece in parsed or piece in blocking):
                        found.append((at, length))
        return found

    def carve(self, text: str) -> List[Tuple[int, int]]:
        """The occurrences llama.cpp carves out: longest texts first, each taking its occurrences
        left to right among the characters no longer text took (texts of one length in the order of
        their starts: llama.cpp leaves the order of equal lengths unspecified). Sorted by start."""
        by_length: Dict[int, List[int]] = {}
        for at, length in set(self.occurrences(text)):
            by_length.setdefault(length, []).append(at)
        starts: List[int] = []  # carved occurrences, sorted and disjoint
        ends: List[int] = []
        for length in sorted(by_length, reverse=True):
            taken: List[Tuple[int, int]] = []
            free_from = 0
            for at in sorted(by_length[length]):
                end = at + length
                if at < free_from:
                    continue
                i = bisect.bisect_left(starts, end)
                if i and ends[i - 1] > at:  # overlaps a longer text already carved
                    continue
                taken.append((at, end))
                free_from = end
            if taken:
                merged = sorted(list(zip(starts, ends)) + taken)
                starts, ends = [s for s, _ in merged], [e for _, e in merged]
        return [(s, e - s) for s, e in zip(starts, ends)]

    def split(self, text: str) -> List[Part]:
        """``text`` as control token ids and the text between them (a user-defined token's text
        stays text), as llama.cpp's special-token parsing splits it.

        >>> SpecialTexts.from_texts({"<s>": 2, "<start>": 5}, []).split("a<start>b<s>")
        ['a', 5, 'b', 2]
        """
        out: List[Part] = []
        cursor = 0
        for at, length in self.carve(text):
            token = self.parsed.get(text[at:at + length])
            if token is None:  # user-defined: text
                continue
            if at > cursor:
                out.append(text[cursor:at])
            out.append(token)
            cursor = at + length
        if cursor < len(text):
            out.append(text[cursor:])
        return out

    def first_parsed(self, text: str) -> Optional[int]:
        """The first control token ``text`` spells (as :meth:`split` finds it), None if none."""
        return next((part for part in self.split(text) if isinstance(part, int)), None)


__all__ = ["SpecialTexts"]
