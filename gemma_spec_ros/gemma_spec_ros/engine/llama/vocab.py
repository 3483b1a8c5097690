"""A vocabulary's identity: what must match between a draft and a target model, and the tag that
learned n-gram cache files carry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .process import load_llama_cpp
from ..errors import VocabMismatchError


@dataclass(frozen=True)
class VocabIdentity:
    """What must match between a draft and a target model (llama.cpp's rule)."""

    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    token_texts_digest: str  # digest of all token texts, to compare without holding both lists

    @property
    def tag(self) -> str:
        """The tag the learned caches of this vocabulary carry (:func:`vocab_tag`)."""
        return vocab_tag(self.vocab_type, self.n_vocab, self.token_texts_digest)


def token_texts_digest(vocab: object) -> str:
    """A digest of every token text of a llama.cpp vocabulary (``llama_model_get_vocab``)."""
    import hashlib

    llama_cpp = load_llama_cpp()
    digest = hashlib.sha1()
    for token in range(int(llama_cpp.llama_vocab_n_tokens(vocab))):
        digest.update(llama_cpp.llama_vocab_get_text(vocab, token) or b"")
        digest.update(b"\0")
    return digest.hexdigest()


def vocab_tag(vocab_type: int, n_vocab: int, token_texts_digest: str) -> str:
    """The tag of a vocabulary: its type, size and a digest of all token texts. Learned cache files
    (drafters/learned_cache.py) carry it, so that a file of another vocabulary is refused.

    >>> vocab_tag(1, 262144, "ab" * 20)
    'vocab-1-262144-abababababababababababababababababababab'
    """
    return f"vocab-{vocab_type}-{n_vocab}-{token_texts_digest}"


def vocab_tag_of(vocab: object) -> str:
    """The tag the learned caches of a llama.cpp vocabulary carry (:func:`vocab_tag`), without a
    loaded model's identity (the lookup-cache builder has only a vocabulary)."""
    llama_cpp = load_llama_cpp()
    return vocab_tag(int(llama_cpp.llama_vocab_type(vocab)), int(llama_cpp.llama_vocab_n_tokens(vocab)),
                     token_texts_digest(vocab))


class LoadedVocab(Protocol):
    """What the compatibility check reads of a loaded model (backend.LlamaModel has it)."""

    path: str

    @property
    def vocab_identity(self) -> "VocabIdentity": ...

    def token_text(self, token: int) -> bytes: ...


def check_vocab_compatible(target: LoadedVocab, draft: LoadedVocab) -> None:
    """Raise VocabMismatchError unless ``draft`` can draft for ``target``.

    llama.cpp's rule (common/speculative): same vocab type, same BOS/EOS (and add-BOS), sizes within
    128 of each other, identical token texts over the common range (we compare all tokens after
    the first 5 control ids like llama.cpp does, over the shared range).
    """
    t, d = target.vocab_identity, draft.vocab_identity
    problems = []
    if t.vocab_type != d.vocab_type:
        problems.append(f"vocab type {d.vocab_type} != target's {t.vocab_type}")
    if abs(t.n_vocab - d.n_vocab) > 128:
        problems.append(f"vocab size {d.n_vocab} differs from target's {t.n_vocab} by more than 128")
    if (t.bos, t.eos, t.add_bos) != (d.bos, d.eos, d.add_bos):
        problems.append(f"BOS/EOS {d.bos}/{d.eos} != target's {t.bos}/{t.eos}")
    if not problems:
        n_common = min(t.n_vocab, d.n_vocab)
        for token in range(5, n_common):
            if target.token_text(token) != draft.token_text(token):
                problems.append(f"token {token} is {draft.token_text(token)!r} in the draft but "
                                f"{target.token_text(token)!r} in the target")
                break
    if problems:
        raise VocabMismatchError(
            f"draft model {draft.path} cannot draft for target {target.path}: " + "; ".join(problems))
