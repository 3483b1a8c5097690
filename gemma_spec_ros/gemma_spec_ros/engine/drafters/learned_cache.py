"""The learned (dynamic) n-gram cache's file: llama.cpp's records behind a header this project owns.

A node writes its learned cache back to ``lookup.dynamic_path``, a path any ROS peer on the domain
could have set. So the engine reads, moves aside or overwrites only a file that starts with this
header, i.e. one it wrote itself; any other file is refused with a reason and left untouched. The
header also names the vocabulary the n-grams belong to: token ids of one vocabulary mean nothing in
another, so a node serving another model refuses the file instead of drafting junk from it.

File layout (little-endian)::

    8 bytes   MAGIC
    uint32    FORMAT_VERSION
    uint32    length of the vocabulary tag in bytes (at most MAX_TAG_BYTES)
    tag       ASCII, zero-padded to a multiple of 4 bytes
    records   llama.cpp's n-gram cache format (see :mod:`.ngram_cache`)

Static caches stay in llama.cpp's plain format (``llama-lookup-create`` makes them); a learned file
may be used as a static cache too (:func:`load_static`).
"""
from __future__ import annotations

import os
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .ngram_cache import NgramCache, read_cache_file
from ..files import PathLike, write_atomically
from ..errors import CacheFormatError

MAGIC = b"\x89GSNGRM\n"  # high bit + name + newline: not text, not a llama.cpp record
FORMAT_VERSION = 1
MAX_TAG_BYTES = 256
_PREFIX = struct.Struct("<8sII")


class ForeignFileError(CacheFormatError):
    """The path names a file this engine did not write (no header): refused, left untouched."""


class VocabularyMismatchError(CacheFormatError):
    """A learned cache of another vocabulary: refused, left untouched."""


class CorruptLearnedCacheError(CacheFormatError):
    """A learned cache (it has the header) whose records are broken: the owner may move it aside."""


def tag_vocab_size(tag: str) -> Optional[int]:
    """The number of tokens of the vocabulary a tag names (a tag of ``llama/vocab.py``'s
    ``vocab_tag``: ``vocab-<type>-<size>-<digest>``), None for any other tag (tests' "vocab-x", "").
    A file's token ids must lie below it: one at or past it is no token of this vocabulary, and a
    draft of it would fail the target's whole batch (llama.cpp refuses it).

    >>> tag_vocab_size("vocab-1-262144-" + "ab" * 20), tag_vocab_size("vocab-x"), tag_vocab_size("")
    (262144, None, None)
    """
    parts = tag.split("-")
    if len(parts) == 4 and parts[0] == "vocab" and parts[2].isdigit() and parts[2].isascii():
        return int(parts[2]) or None
    return None


def in_vocabulary(tokens: Sequence[int], n_vocab: Optional[int]) -> int:
    """How many of ``tokens``, from the first, are ids of a vocabulary of ``n_vocab`` tokens (all
    of them if ``n_vocab`` is None): where a drafter cuts a draft (the first id outside would fail
    the target's whole batch; those after it continue that token).

    >>> in_vocabulary([5, 39, 40, 3], 40), in_vocabulary([5, 40], None), in_vocabulary([-1], 40)
    (2, 2, 0)
    """
    if n_vocab is None:
        return len(tokens)
    for i, token in enumerate(tokens):
        if not 0 <= token < n_vocab:
            return i
    return len(tokens)


def encode(cache: NgramCache, tag: str) -> bytes:
    """``cache`` as a learned-cache file for the vocabulary ``tag``."""
    raw_tag = tag.encode("ascii")
    if len(raw_tag) > MAX_TAG_BYTES:
        raise ValueError(f"vocabulary tag of {len(raw_tag)} bytes: at most {MAX_TAG_BYTES}")
    padding = b"\0" * (-len(raw_tag) % 4)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw_tag)) + raw_tag + padding + cache.to_bytes()


def _is_learned(data: bytes) -> bool:
    return data[:len(MAGIC)] == MAGIC


def _not_ours(source: str) -> ForeignFileError:
    return ForeignFileError(
        f"{source} is not a learned n-gram cache written by gemma_spec (no header): it is left "
        "untouched and not used; point lookup.dynamic_path at a new file or at one this node wrote")


def _split(data: bytes, source: str) -> Tuple[str, bytes]:
    """(vocabulary tag, records) of a learned-cache file; raises as :func:`decode`."""
    if not _is_learned(data):
        raise _not_ours(source)
    if len(data) < _PREFIX.size:
        raise CorruptLearnedCacheError(f"learned n-gram cache {source}: header truncated")
    _, version, tag_bytes = _PREFIX.unpack_from(data)
    body_start = _PREFIX.size + tag_bytes + (-tag_bytes % 4)
    raw_tag = data[_PREFIX.size:_PREFIX.size + tag_bytes]
    if version != FORMAT_VERSION or tag_bytes > MAX_TAG_BYTES or body_start > len(data) \
            or not raw_tag.isascii():
        raise CorruptLearnedCacheError(
            f"learned n-gram cache {source}: unknown format version or broken header")
    return raw_tag.decode("ascii"), data[body_start:]


def _records(body: bytes, source: str, max_ngrams: Optional[int], n_vocab: Optional[int]) -> NgramCache:
    """The records of a file; a token id ``>= n_vocab`` makes the file damaged, as a broken record does."""
    try:
        return NgramCache.from_bytes(body, source=source, max_ngrams=max_ngrams, n_vocab=n_vocab)
    except CacheFormatError as error:
        raise CorruptLearnedCacheError(str(error)) from None


def decode(data: bytes, source: str, tag: str, max_ngrams: Optional[int] = None,
           n_vocab: Optional[int] = None) -> NgramCache:
    """The n-grams of a learned-cache file of the vocabulary ``tag``.

    Raises :class:`ForeignFileError` without the header, :class:`VocabularyMismatchError` for
    another vocabulary, :class:`CorruptLearnedCacheError` for broken records (or too many of them,
    or a token id at or past ``n_vocab``, by default the size ``tag`` names: :func:`tag_vocab_size`).
    The messages never quote the file's content.
    """
    file_tag, body = _split(data, source)
    if file_tag != tag:
        raise VocabularyMismatchError(
            f"learned n-gram cache {source} was learned with another vocabulary (another model "
            "family): it is left untouched and not used; give this model its own lookup.dynamic_path")
    return _records(body, source, max_ngrams, tag_vocab_size(tag) if n_vocab is None else n_vocab)


def read(path: PathLike) -> Tuple[str, NgramCache]:
    """(vocabulary tag, n-grams) of the learned-cache file ``path``, whatever its vocabulary
    (tools that inspect a file); raises as :func:`decode`."""
    file_tag, body = _split(read_cache_file(path), os.fspath(path))
    return file_tag, _records(body, os.fspath(path), None, tag_vocab_size(file_tag))


def load(path: PathLike, tag: str, max_ngrams: Optional[int] = None, n_vocab: Optional[int] = None) -> NgramCache:
    """The learned cache at ``path``; an empty one if the file does not exist yet (the first
    :func:`save` creates it). Raises as :func:`decode`, or CacheFormatError if it cannot be read."""
    if not os.path.lexists(os.fspath(path)):
        return NgramCache()
    return decode(read_cache_file(path), os.fspath(path), tag, max_ngrams, n_vocab)


def load_static(path: PathLike, tag: str, max_ngrams: Optional[int] = None,
                n_vocab: Optional[int] = None) -> NgramCache:
    """A static cache: llama.cpp's plain format, or a learned-cache file (of the vocabulary ``tag``).

    A plain file names no vocabulary, but one holding a token id at or past ``n_vocab`` (by default
    the size ``tag`` names: :func:`tag_vocab_size`) was built for another model: it is refused
    (CacheFormatError), as a broken one is."""
    data = read_cache_file(path)
    if n_vocab is None:
        n_vocab = tag_vocab_size(tag)
    if _is_learned(data):
        return decode(data, os.fspath(path), tag, max_ngrams, n_vocab)
    return NgramCache.from_bytes(data, source=os.fspath(path), max_ngrams=max_ngrams, n_vocab=n_vocab)


def owned_file(path: PathLike, magic: bytes, what: str) -> Optional[bool]:
    """None if ``path`` does not exist, else whether it is a regular file starting with ``magic``
    (``what`` names the file in the error). Opened without blocking and checked on the descriptor
    (a FIFO cannot hang the caller)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ForeignFileError(f"cannot check {os.fspath(path)} ({what}): "
                               f"{error.strerror or error}") from None
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(magic)) == magic
    finally:
        os.close(fd)


def _owned(path: PathLike) -> Optional[bool]:
    return owned_file(path, MAGIC, "the learned n-gram cache")


def check_owned(path: PathLike) -> None:
    """Raise :class:`ForeignFileError` unless ``path`` is absent or a regular file with the header
    (before writing over it)."""
    if _owned(path) is False:
        raise ForeignFileError(
            f"refusing to overwrite {os.fspath(path)} with the learned n-gram cache: the file was "
            "not written by gemma_spec (no header)")


def check_loadable(path: PathLike) -> None:
    """Raise :class:`ForeignFileError` as :func:`load` would, unless ``path`` is absent or a
    regular file with the header: reads the header only (the node's check before it loads models;
    the vocabulary and the records are checked at the load)."""
    if _owned(path) is False:
        raise _not_ours(os.fspath(path))


def save(cache: NgramCache, path: PathLike, tag: str) -> None:
    """Write ``cache`` to ``path`` atomically, only over a file this engine wrote (or none)."""
    check_owned(path)
    write_atomically(path, encode(cache, tag))


#: Mode of every folder the engine creates for its learned cache: the cache holds the token ids of
#: past prompts, so only the node's user may list or read it (XDG asks the same of ~/.cache).
FOLDER_MODE = 0o700


def prepare_folder(path: PathLike, cache_dir: str) -> List[str]:
    """Make sure the folder of the learned-cache file ``path`` exists and is writable; the folders
    created (outermost first), each :data:`FOLDER_MODE`.

    A folder is created only where the engine owns the place: ``cache_dir`` (the folder the learned
    cache must lie in, ``lookup.cache_dir``), its missing parents and folders below it, as
    ``mkdir -p`` would. Without a ``cache_dir`` nothing is created, and a missing folder raises
    :class:`CacheFormatError` with what to do. A robot's first launch then needs no setup step: the
    shipped profiles put the cache at ``~/.cache/gemma_spec_ros/...``, which a fresh home lacks.

    >>> import tempfile; home = tempfile.mkdtemp()
    >>> created = prepare_folder(f"{home}/.cache/node/learned.bin", f"{home}/.cache/node")
    >>> [p[len(home):] for p in created], oct(os.stat(created[-1]).st_mode & 0o777)
    (['/.cache', '/.cache/node'], '0o700')
    >>> prepare_folder(f"{home}/.cache/node/learned.bin", f"{home}/.cache/node")  # there: nothing to do
    []
    """
    folder = Path(os.path.abspath(os.fspath(path))).parent
    if folder.is_dir():
        _check_writable(folder)
        return []
    if not cache_dir or not _inside(folder, Path(os.path.abspath(cache_dir))):
        raise CacheFormatError(
            f"the folder of the dynamic n-gram cache {os.fspath(path)} does not exist: create it, "
            "or set lookup.dynamic_path to '' (memory only)")
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    created: List[str] = []
    for step in missing:
        try:
            step.mkdir(mode=FOLDER_MODE)
        except FileExistsError:  # made meanwhile (another node of this user): use it if a folder
            pass
        except OSError as error:
            raise CacheFormatError(f"cannot create {step} for the dynamic n-gram cache: "
                                   f"{error.strerror or error}") from None
        else:
            created.append(os.fspath(step))
    if not folder.is_dir():
        raise CacheFormatError(f"{folder} is not a folder: the dynamic n-gram cache cannot go there")
    _check_writable(folder)
    return created


def _inside(folder: Path, root: Path) -> bool:
    """Whether ``folder`` is ``root`` or below it (both absolute; the existing part of ``folder`` is
    resolved, so a link inside ``root`` that leads out of it does not count as inside)."""
    real_root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(folder), real_root]) == real_root


def _check_writable(folder: Path) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CacheFormatError(f"the folder of the dynamic n-gram cache {folder} is not writable by "
                               "this user: the learned cache could not be saved there")


def move_aside(path: PathLike) -> str:
    """Rename the (corrupt, own) file ``path`` to a new unique ``<path>.corrupt-<time>-<random>``
    name and return it; never replaces an earlier aside file."""
    target = Path(path)
    fd, aside = tempfile.mkstemp(dir=os.fspath(target.parent),
                                 prefix=f"{target.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-")
    os.close(fd)
    os.replace(target, aside)
    return aside
