"""Tokens to text: whole UTF-8 characters, stop strings cut (pure; no model needed).

A token's bytes may end inside a multi-byte character, and a stop string may span tokens: both are
held back until the next tokens settle them.
"""
from __future__ import annotations

import codecs
from typing import Sequence


class Utf8Stream:
    """Bytes in, whole characters out: a multi-byte character split across tokens is held back.

    >>> s = Utf8Stream(); s.push(b"caf\\xc3"), s.push(b"\\xa9!")
    ('caf', 'é!')
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class TextAssembler:
    """Tokens in, text out: whole UTF-8 characters, stop strings cut, text that might be the start
    of a stop string held back until it is known not to be.

    >>> class V:  # a vocabulary of single-character tokens
    ...     def token_bytes(self, t): return bytes([t])
    >>> a = TextAssembler(V(), ("END",))
    >>> a.push([ord(c) for c in "abE"]), a.push([ord(c) for c in "Nx"]), a.stopped
    ('ab', 'ENx', False)
    >>> a.push([ord(c) for c in "yEND!"]), a.stopped
    ('y', True)
    """

    def __init__(self, vocab, stop: Sequence[str]) -> None:
        self._vocab = vocab
        self._utf8 = Utf8Stream()
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False
        self.text = ""  # everything released so far

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._held += self._utf8.push(b"".join(self._vocab.token_bytes(t) for t in tokens))
        return self._release(final=False)

    def final(self, ended: str) -> None:
        """A prompt's generation has no message beside its text (a chat turn's stream has one)."""
        return None

    def flush(self) -> str:
        if self.stopped:
            return ""
        self._held += self._utf8.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        cut = min((i for i in (held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._held = held[:cut], ""
        elif final or not self._stop:
            out, self._held = held, ""
        else:  # keep the longest tail that is a proper prefix of some stop string
            keep = 0
            for s in self._stop:
                for n in range(min(len(s) - 1, len(held)), keep, -1):
                    if held.endswith(s[:n]):
                        keep = n
                        break
            out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        self.text += out
        return out
