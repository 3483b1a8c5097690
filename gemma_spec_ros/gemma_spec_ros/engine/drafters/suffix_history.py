"""The suffix drafter's history file: earlier outputs, one token sequence each, behind a header.

The same rules as the learned n-gram cache (:mod:`.learned_cache`), whose folder it shares: the node
reads, moves aside or overwrites only a file that starts with this header (one it wrote); any other
file is refused with a reason and left untouched. The header names the vocabulary (token ids of one
mean nothing in another) and carries a CRC-32 of the body, so a damaged file (a disk error, a cut
write of another tool) is told from a good one and moved aside instead of drafting junk. So is one
holding a token id the vocabulary lacks (at or past the size its tag names): its drafts would fail
the target's whole batch (llama.cpp refuses an id it does not know).

File layout (little-endian)::

    8 bytes   MAGIC
    uint32    FORMAT_VERSION
    uint32    length of the vocabulary tag in bytes (at most learned_cache.MAX_TAG_BYTES)
    tag       ASCII, zero-padded to a multiple of 4 bytes
    uint32    CRC-32 of the body
    body:     uint32 number of sequences S, S x uint32 lengths, then every sequence's int32 token ids
"""
from __future__ import annotations

import os
import struct
import sys
import zlib
from array import array
from typing import List, Optional, Sequence

import numpy as np

from .learned_cache import (MAX_TAG_BYTES, CorruptLearnedCacheError, ForeignFileError, VocabularyMismatchError,
                            owned_file, tag_vocab_size)
from ..files import PathLike, write_atomically
from .ngram_cache import read_cache_file

MAGIC = b"\x89GSSUFX\n"  # high bit + name + newline: not text, not an n-gram cache
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
_WORD = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"


def _words(values: Sequence[int], typecode: str) -> bytes:
    """``values`` as little-endian 32-bit words."""
    words = array(typecode, values)
    if not _LITTLE:
        words.byteswap()
    return words.tobytes()


def encode(sequences: Sequence[Sequence[int]], tag: str) -> bytes:
    """``sequences`` (token ids in 0 .. 2**31 - 1) as a history file of the vocabulary ``tag``.

    >>> data = encode([[1, 2, 3], [7]], "vocab-x")
    >>> decode(data, "<bytes>", "vocab-x")
    [[1, 2, 3], [7]]
    """
    raw_tag = tag.encode("ascii")
    if len(raw_tag) > MAX_TAG_BYTES:
        raise ValueError(f"vocabulary tag of {len(raw_tag)} bytes: at most {MAX_TAG_BYTES}")
    body = (_WORD.pack(len(sequences)) + _words([len(s) for s in sequences], "I")
            + b"".join(_words(s, "i") for s in sequences))
    header = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw_tag)) + raw_tag + b"\0" * (-len(raw_tag) % 4)
    return header + _WORD.pack(zlib.crc32(body)) + body


def _not_ours(source: str) -> ForeignFileError:
    return ForeignFileError(
        f"{source} is not a suffix history written by gemma_spec (no header): it is left untouched "
        "and not used; point suffix.history_path at a new file or at one this node wrote")


def _corrupt(source: str, problem: str) -> CorruptLearnedCacheError:
    return CorruptLearnedCacheError(f"suffix history {source}: {problem}")


def decode(data: bytes, source: str, tag: str, max_tokens: Optional[int] = None,
           n_vocab: Optional[int] = None) -> List[List[int]]:
    """The sequences of a history file of the vocabulary ``tag``: all, or the newest that hold
    at most ``max_tokens`` tokens together (a bound lowered since the file was saved; only those
    become Python lists).

    Raises :class:`~.learned_cache.ForeignFileError` without the header,
    :class:`~.learned_cache.VocabularyMismatchError` for another vocabulary and
    :class:`~.learned_cache.CorruptLearnedCacheError` for a damaged one (header, checksum, sizes, a
    token id below 0 or at or past ``n_vocab``, by default the size ``tag`` names
    (:func:`~.learned_cache.tag_vocab_size`): the target could not decode its drafts). The messages
    never quote the file's content.

    >>> try:
    ...     decode(encode([[1, 2], [39, 40]], "vocab-1-40-ab"), "<bytes>", "vocab-1-40-ab")
    ... except CorruptLearnedCacheError as error:
    ...     print(error)
    suffix history <bytes>: a token id outside the vocabulary of 40 tokens (the file is damaged)
    """
    if data[:len(MAGIC)] != MAGIC:
        raise _not_ours(source)
    if len(data) < _PREFIX.size:
        raise _corrupt(source, "header truncated")
    _, version, tag_bytes = _PREFIX.unpack_from(data)
    crc_at = _PREFIX.size + tag_bytes + (-tag_bytes % 4)
    raw_tag = data[_PREFIX.size:_PREFIX.size + tag_bytes]
    if version != FORMAT_VERSION or tag_bytes > MAX_TAG_BYTES or crc_at + 2 * _WORD.size > len(data) \
            or not raw_tag.isascii():
        raise _corrupt(source, "unknown format version or broken header")
    if raw_tag.decode("ascii") != tag:
        raise VocabularyMismatchError(
            f"suffix history {source} was written for another vocabulary (another model family): "
            "it is left untouched and not used; give this model its own suffix.history_path")
    (crc,) = _WORD.unpack_from(data, crc_at)
    body = memoryview(data)[crc_at + _WORD.size:]
    if zlib.crc32(body) != crc:
        raise _corrupt(source, "checksum mismatch (the file is damaged)")
    return _sequences(body, source, max_tokens, tag_vocab_size(tag) if n_vocab is None else n_vocab)


def _sequences(body: memoryview, source: str, max_tokens: Optional[int],
               n_vocab: Optional[int]) -> List[List[int]]:
    (count,) = _WORD.unpack_from(body)
    lengths_end = _WORD.size * (1 + count)
    if lengths_end > len(body):
        raise _corrupt(source, f"{count} sequences announced, the file is shorter")
    lengths = np.frombuffer(body, dtype="<u4", count=count, offset=_WORD.size).astype(np.int64)
    ends = np.cumsum(lengths)  # each sequence's end, in tokens
    total = int(ends[-1]) if count else 0
    if lengths_end + 4 * total != len(body):
        raise _corrupt(source, "sequence lengths do not add up to the file's size")
    tokens = np.frombuffer(body, dtype="<i4", offset=lengths_end)  # a view: no copy, no int objects
    if tokens.size and int(tokens.min()) < 0:
        raise _corrupt(source, "a negative token id")
    if tokens.size and n_vocab is not None and int(tokens.max()) >= n_vocab:
        raise _corrupt(source, f"a token id outside the vocabulary of {n_vocab} tokens (the file is damaged)")
    # the newest sequences holding at most max_tokens tokens (the oldest kept may be cut), found on
    # the lengths: only the kept tokens become Python ints
    room = total + 1 if max_tokens is None else max_tokens
    kept: List[List[int]] = []
    for index in range(count - 1, -1, -1):
        if room <= 0:
            break
        end = int(ends[index])
        start = end - int(lengths[index])
        kept.append(tokens[max(start, end - room):end].tolist())
        room -= end - start
    return kept[::-1]


def load(path: PathLike, tag: str, max_tokens: Optional[int] = None,
         n_vocab: Optional[int] = None) -> List[List[int]]:
    """The history at ``path``; none if the file does not exist yet (the first :func:`save` creates
    it). Raises as :func:`decode`, or CacheFormatError if it cannot be read."""
    if not os.path.lexists(os.fspath(path)):
        return []
    return decode(read_cache_file(path), os.fspath(path), tag, max_tokens, n_vocab)


def _owned(path: PathLike) -> Optional[bool]:
    return owned_file(path, MAGIC, "the suffix history")


def check_loadable(path: PathLike) -> None:
    """Raise :class:`~.learned_cache.ForeignFileError` unless ``path`` is absent or a regular file
    with the header (the node's check before it loads models; the rest is checked at the load)."""
    if _owned(path) is False:
        raise _not_ours(os.fspath(path))


def save(sequences: Sequence[Sequence[int]], path: PathLike, tag: str) -> None:
    """Write the history to ``path`` atomically, only over a file this engine wrote (or none)."""
    if _owned(path) is False:
        raise ForeignFileError(
            f"refusing to overwrite {os.fspath(path)} with the suffix history: the file was not "
            "written by gemma_spec (no header)")
    write_atomically(path, encode(sequences, tag))
