"""A vocabulary's identity: what must match between a draft and a target model, and the tag that
learned n-gram cache files carry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from . import learned_cache
from .llama_process import _llama
from .types import VocabMismatchError


@dataclass(frozen=True)
class VocabIdentity:
    """What must match between a draft and a target model (llama.cpp's rule)."""

    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    token_texts_digest: str  # digest of all token texts, to compare without holding both lists


def token_texts_digest(vocab: object) -> str:
    """A digest of every token text of a llama.cpp vocabulary (``llama_model_get_vocab``)."""
    import hashlib

    llama_cpp = _llama()
    digest = hashlib.sha1()
    for token in range(int(llama_cpp.llama_vocab_n_tokens(vocab))):
        digest.update(llama_cpp.llama_vocab_get_text(vocab, token) or b"")
        digest.update(b"\0")
    return digest.hexdigest()


def vocab_tag_of(vocab: object) -> str:
    """The tag learned n-gram cache files of a llama.cpp vocabulary carry (learned_cache.vocab_tag)."""
    llama_cpp = _llama()
    return learned_cache.vocab_tag(int(llama_cpp.llama_vocab_type(vocab)),
                                   int(llama_cpp.llama_vocab_n_tokens(vocab)), token_texts_digest(vocab))


class LoadedVocab(Protocol):
    """What the compatibility check reads of a loaded model (backend.LlamaBackend has it)."""

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
