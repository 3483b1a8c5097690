"""N-gram continuation counts, file-compatible with llama.cpp's ``common/ngram-cache``.

An n-gram cache maps an n-gram (1 to :data:`NGRAM_MAX` tokens) to the tokens that followed it and
how often: ``(5, 6) -> {7: 3, 9: 1}`` means "5 6" was followed by 7 three times and by 9 once.
The lookup drafter (:mod:`gemma_spec_ros.engine.drafters.lookup`) drafts from three such caches.

File format (llama.cpp's ``common_ngram_cache_save`` / ``_load``; little-endian, no header): a
sequence of records, one per n-gram::

    int32 ngram[4]      the n-gram's tokens, padded at the end with -1 (LLAMA_TOKEN_NULL)
    int32 n             number of distinct continuations, >= 1
    n x (int32 token, int32 count)     count >= 1

Record order is unspecified (llama.cpp writes its hash-map order), so two caches are equal when
they hold the same n-grams with the same counts, whatever their files' byte order.

In memory an n-gram is a tuple of its real tokens (no padding): ``(5, 6)``, not ``(5, 6, -1, -1)``.
"""
from __future__ import annotations

import array
import itertools
import os
import sys
from typing import Dict, ItemsView, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CacheFormatError
from ..files import PathLike, read_regular_file, write_atomically

#: Longest n-gram the file format holds (llama.cpp's LLAMA_NGRAM_MAX).
NGRAM_MAX = 4
#: N-gram size of static caches built from a corpus (llama.cpp's LLAMA_NGRAM_STATIC).
NGRAM_STATIC = 2
#: Filler after the tokens of an n-gram shorter than NGRAM_MAX (llama.cpp's LLAMA_TOKEN_NULL).
PAD_TOKEN = -1

_INT32 = np.dtype("<i4")
#: The largest count the file's int32 holds: counts stop there (saturate) in :meth:`NgramCache.update`
#: and :meth:`NgramCache.merge`, so a cache that learns for months still saves. A saturated count
#: ranks its continuation first, as the true count would.
COUNT_MAX = 2**31 - 1
_WORD_BYTES = _INT32.itemsize
#: int32 words before a record's (token, count) pairs: the padded n-gram and the pair count.
_HEADER_WORDS = NGRAM_MAX + 1

#: Records parsed per chunk when building the table (bounds the temporary lists).
_BUILD_CHUNK = 1 << 16
#: On a little-endian host the file's words read as native ints without a copy.
_NATIVE_LITTLE = sys.byteorder == "little"

Ngram = Tuple[int, ...]


class CacheFileNotFoundError(CacheFormatError, FileNotFoundError):
    """An n-gram cache file does not exist. Both a :class:`CacheFormatError` (what callers of the
    engine catch) and a :class:`FileNotFoundError` (what file-handling code expects)."""


def _check_ngram_sizes(ngram_min: int, ngram_max: int) -> None:
    if not 1 <= ngram_min <= ngram_max <= NGRAM_MAX:
        raise ValueError(
            f"n-gram sizes {ngram_min}..{ngram_max}: need 1 <= min <= max <= {NGRAM_MAX}")


def _as_ngram(tokens: Sequence[int]) -> Ngram:
    """``tokens`` as an in-memory n-gram key: Python ints, trailing :data:`PAD_TOKEN` removed."""
    ngram = [int(t) for t in tokens]
    while ngram and ngram[-1] == PAD_TOKEN:
        ngram.pop()
    return tuple(ngram)


class NgramCache:
    """Counts of the tokens that followed each n-gram of some token sequences.

    >>> cache = NgramCache()
    >>> cache.update([5, 6, 7, 5, 6, 9], ngram_min=2, ngram_max=2)
    >>> cache.get([5, 6])
    {7: 1, 9: 1}
    >>> cache.get([6, 9]) is None    # "6 9" ends the sequence: nothing followed it
    True
    """

    def __init__(self) -> None:
        # n-gram -> {continuation token: count}. The dicts' insertion order (first sighting,
        # or file order) decides ties when drafting; see lookup._most_likely_continuation.
        self._table: Dict[Ngram, Dict[int, int]] = {}

    # ----------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        """Number of distinct n-grams."""
        return len(self._table)

    def __contains__(self, ngram: Sequence[int]) -> bool:
        return _as_ngram(ngram) in self._table

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NgramCache):
            return NotImplemented
        return self._table == other._table

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"NgramCache({len(self)} n-grams)"

    def __iter__(self) -> Iterator[Ngram]:
        return iter(self._table)

    def items(self) -> ItemsView[Ngram, Dict[int, int]]:
        """``(ngram, {token: count})`` pairs; read-only by convention."""
        return self._table.items()

    def get(self, ngram: Sequence[int]) -> Optional[Dict[int, int]]:
        """The continuations ``{token: count}`` of ``ngram`` (1 to 4 tokens; trailing -1 padding is
        ignored), or None if it was never followed by anything. The mapping is the cache's own:
        do not modify it. Fastest with a tuple of ints."""
        if type(ngram) is not tuple or (ngram and ngram[-1] == PAD_TOKEN):  # noqa: E721
            ngram = _as_ngram(ngram)
        return self._table.get(ngram)

    @property
    def total_count(self) -> int:
        """Sum of all counts: how many (n-gram, continuation) observations the cache holds."""
        return sum(sum(part.values()) for part in self._table.values())

    # --------------------------------------------------------------------------------- mutation
    def update(self, tokens: Sequence[int], ngram_min: int, ngram_max: int,
               start_index: int = 0, stop_index: Optional[int] = None) -> None:
        """Count, for every position ``i`` in ``[start_index, stop_index)``, the token ``tokens[i]``
        as a continuation of each n-gram of size ``ngram_min..ngram_max`` that ends at ``i - 1``.

        This is llama.cpp's ``common_ngram_cache_update(cache, ngram_min, ngram_max, tokens, nnew)``
        with ``start_index = len(tokens) - nnew``: to add tokens appended since the last update,
        pass the previous length as ``start_index``. Only ``tokens[start_index - ngram_max:
        stop_index]`` is read, so the cost is proportional to the new tokens, not to the sequence.

        >>> cache = NgramCache()
        >>> seq = [1, 2, 3]
        >>> cache.update(seq, 1, 2)
        >>> sorted(cache.items())
        [((1,), {2: 1}), ((1, 2), {3: 1}), ((2,), {3: 1})]
        >>> seq.append(1)
        >>> cache.update(seq, 1, 2, start_index=3)     # only the n-grams ending before the new 1
        >>> cache.get((3,)), cache.get((2, 3))
        ({1: 1}, {1: 1})
        """
        _check_ngram_sizes(ngram_min, ngram_max)
        if start_index < 0:
            raise ValueError(f"start_index={start_index}: must be >= 0")
        stop = len(tokens) if stop_index is None else min(stop_index, len(tokens))
        window_start = max(0, start_index - ngram_max)
        if stop <= max(start_index, ngram_min):
            return
        window = [int(t) for t in tokens[window_start:stop]]
        table = self._table
        for size in range(ngram_min, ngram_max + 1):
            first = max(start_index, size) - window_start  # first continuation, window index
            continuations = window[first:]
            # the n-grams ending just before each continuation, built as tuples by zip
            ngrams = zip(*(window[first - size + k:len(window) - size + k] for k in range(size)))
            for ngram, continuation in zip(ngrams, continuations):
                part = table.get(ngram)
                if part is None:
                    table[ngram] = {continuation: 1}
                else:
                    count = part.get(continuation, 0)
                    if count < COUNT_MAX:
                        part[continuation] = count + 1

    def prune(self, max_ngrams: int, keep_fraction: float = 0.9) -> int:
        """If the cache holds more than ``max_ngrams`` n-grams, evict the least useful down to
        ``keep_fraction * max_ngrams``: the smallest sample sizes (times seen), the oldest first
        among equals (insertion order). Returns how many were evicted.

        >>> cache = NgramCache(); cache.update([1, 2, 1, 2, 1, 2, 3, 4], 1, 1); len(cache)
        3
        >>> cache.prune(2, keep_fraction=1.0), sorted(cache)
        (1, [(1,), (2,)])
        """
        table = self._table
        if len(table) <= max_ngrams:
            return 0
        keep = max(1, int(max_ngrams * keep_fraction))
        totals = np.fromiter((sum(part.values()) for part in table.values()), dtype=np.int64,
                             count=len(table))
        order = np.lexsort((np.arange(len(table)), totals))  # by total, then age (oldest first)
        evict = set(order[:len(table) - keep].tolist())
        self._table = {ngram: part for i, (ngram, part) in enumerate(table.items()) if i not in evict}
        return len(evict)

    def merge(self, other: "NgramCache") -> None:
        """Add all counts of ``other`` to this cache (llama.cpp's ``common_ngram_cache_merge``),
        each sum stopping at :data:`COUNT_MAX`.

        >>> a, b = NgramCache(), NgramCache()
        >>> a.update([1, 2], 1, 1); b.update([1, 2, 1, 3], 1, 1)
        >>> a.merge(b); a.get((1,))
        {2: 2, 3: 1}
        >>> full = NgramCache.from_bytes(np.array([1, -1, -1, -1, 1, 2, COUNT_MAX], "<i4").tobytes())
        >>> full.merge(full); full.update([1, 2], 1, 1); full.get((1,)) == {2: COUNT_MAX}
        True
        """
        table = self._table
        for ngram, other_part in other._table.items():
            part = table.get(ngram)
            if part is None:
                table[ngram] = {token: min(count, COUNT_MAX) for token, count in other_part.items()}
                continue
            for token, count in other_part.items():
                part[token] = min(part.get(token, 0) + count, COUNT_MAX)

    def clear(self) -> None:
        """Forget every n-gram."""
        self._table.clear()

    # ---------------------------------------------------------------------------- serialization
    def to_bytes(self) -> bytes:
        """The cache in llama.cpp's file format (see the module docstring)."""
        words: List[int] = []
        for ngram, part in self._table.items():
            words.extend(ngram)
            words.extend([PAD_TOKEN] * (NGRAM_MAX - len(ngram)))
            words.append(len(part))
            words.extend(itertools.chain.from_iterable(part.items()))
        # through int64 and checked: numpy before 2.0 (Ubuntu 22.04's 1.21) wraps a Python int past
        # int32 silently where numpy 2 raises
        try:
            wide = np.asarray(words, dtype=np.int64)
        except OverflowError as error:
            raise ValueError(f"an n-gram count does not fit the file's int32: {error}") from None
        if wide.size and (wide.max() > COUNT_MAX or wide.min() < -COUNT_MAX - 1):
            # a count set past COUNT_MAX other than by update/merge
            raise ValueError(f"an n-gram count does not fit the file's int32: {int(wide.max())}")
        return wide.astype(_INT32).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>", max_ngrams: Optional[int] = None,
                   n_vocab: Optional[int] = None) -> "NgramCache":
        """Parse llama.cpp's file format. ``source`` names the data in error messages.

        Raises :class:`CacheFormatError` naming ``source`` and the byte offset of a record that
        is truncated or invalid (n-gram not 1-4 tokens >= 0 then -1 padding,
        continuation count ``n < 1`` or larger than the bytes left, a token < 0 or count < 1,
        a token or n-gram repeated), or holding more than ``max_ngrams`` n-grams, or (with
        ``n_vocab``) a token id ``>= n_vocab`` (a cache of another model, whose drafts the target
        could not even decode); never anything else. The messages never quote a value read from
        the data: a path a peer names may be any file, and the reason is published (on /diagnostics).

        Memory: the records are found and checked on the buffer itself (no Python object per word),
        and the table is built a chunk of records at a time, so a file that is not a cache costs
        little more than its own size, and a valid one what its n-grams hold.
        """
        n_words = len(data) // _WORD_BYTES
        words = np.frombuffer(data, dtype=_INT32, count=n_words)
        # Python ints without a list of the whole file (a view, native byte order = the file's)
        word_at = memoryview(data)[:n_words * _WORD_BYTES].cast("i") if _NATIVE_LITTLE else words

        def fail(word_index: int, problem: str) -> CacheFormatError:
            return CacheFormatError(
                f"n-gram cache {source}: {problem} at byte offset {word_index * _WORD_BYTES} "
                f"(file size {len(data)} bytes); the file is truncated or not an n-gram cache "
                "written by gemma-spec-lookup-create or llama.cpp")

        # 1. Find the records (a walk over the headers only), up to the first broken one.
        #    Problems are (word index, description); the one earliest in the file is reported.
        problems: List[Tuple[int, str]] = []
        record_starts = array.array("i")  # word indices: < 2**31 for files <= MAX_FILE_BYTES
        pos = 0
        while pos < n_words:
            pairs_start = pos + _HEADER_WORDS
            if pairs_start > n_words:
                problems.append((pos, "record header truncated"))
                break
            n_pairs = int(word_at[pos + NGRAM_MAX])
            if n_pairs < 1:
                problems.append((pos + NGRAM_MAX, "continuation count below 1"))
                break
            if pairs_start + 2 * n_pairs > n_words:
                problems.append((pos + NGRAM_MAX, "continuation count past the end of the data"))
                break
            if max_ngrams is not None and len(record_starts) >= max_ngrams:
                raise CacheFormatError(
                    f"n-gram cache {source} holds more than {max_ngrams} n-grams, the most this "
                    f"node keeps in memory ({len(data)} bytes): use a smaller cache file")
            record_starts.append(pos)
            pos = pairs_start + 2 * n_pairs
        if not problems and len(data) % _WORD_BYTES:  # a few bytes after the last record
            problems.append((n_words, "record header truncated"))

        # 2. Check the values of all whole records at once (numpy).
        starts = np.frombuffer(record_starts, dtype=np.intc) if record_starts else np.zeros(0, np.intc)
        # column by column: a (records x 4) int64 index array would cost 32 bytes per record
        ngram_words = np.empty((len(starts), NGRAM_MAX), dtype=_INT32)
        for column in range(NGRAM_MAX):
            ngram_words[:, column] = words[starts + column]
        is_pad = ngram_words == PAD_TOKEN
        bad_ngram = ((ngram_words[:, 0] < 0) | (ngram_words < PAD_TOKEN).any(axis=1)
                     | (is_pad[:, :-1] & ~is_pad[:, 1:]).any(axis=1))  # padding only at the end
        if bad_ngram.any():
            problems.append((int(starts[int(np.argmax(bad_ngram))]), "invalid n-gram"))
        is_pair_word = np.ones(pos, dtype=bool)
        for column in range(_HEADER_WORDS):
            is_pair_word[starts + column] = False
        pairs = words[:pos][is_pair_word].reshape(-1, 2)
        bad_pair = (pairs[:, 0] < 0) | (pairs[:, 1] < 1)
        if bad_pair.any():
            pair_word = int(np.flatnonzero(is_pair_word)[2 * int(np.argmax(bad_pair))])
            problems.append((pair_word, "invalid continuation (token < 0 or count < 1)"))
        if problems:
            raise fail(*min(problems))
        if n_vocab is not None:
            _check_vocabulary(ngram_words, pairs, starts, is_pair_word, n_vocab, source)

        # 3. Build the table, a chunk of records at a time (no list of the whole file).
        cache = cls()
        table = cache._table
        ngram_sizes = NGRAM_MAX - is_pad.sum(axis=1)
        n_pairs_of = words[starts + NGRAM_MAX].astype(np.int64)
        pair_ends = np.cumsum(n_pairs_of)
        for first in range(0, len(starts), _BUILD_CHUNK):
            last = min(first + _BUILD_CHUNK, len(starts))
            pair_begin = int(pair_ends[first - 1]) if first else 0
            values = pairs[pair_begin:int(pair_ends[last - 1])].ravel().tolist()
            offset = 0
            for record, padded, size, n_pairs in zip(
                    range(first, last), ngram_words[first:last].tolist(),
                    ngram_sizes[first:last].tolist(), n_pairs_of[first:last].tolist()):
                end = offset + 2 * n_pairs
                part = dict(zip(values[offset:end:2], values[offset + 1:end:2]))
                ngram = tuple(padded[:size])
                if len(part) != n_pairs:
                    raise fail(int(starts[record]) + _HEADER_WORDS, "a continuation token repeats")
                if ngram in table:
                    raise fail(int(starts[record]), "an n-gram appears twice")
                table[ngram] = part
                offset = end
        return cache

    def save(self, path: PathLike) -> None:
        """Write the cache to ``path`` in llama.cpp's format, atomically (see :func:`write_atomically`).
        The node's learned cache is saved with a header instead: :mod:`.learned_cache`."""
        write_atomically(path, self.to_bytes())

    @classmethod
    def load(cls, path: PathLike, max_ngrams: Optional[int] = None) -> "NgramCache":
        """Read a cache file written by :meth:`save`, ``gemma-spec-lookup-create``, or llama.cpp's
        ``llama-lookup-create`` / ``llama-lookup``.

        Raises :class:`CacheFileNotFoundError` if ``path`` does not exist and
        :class:`CacheFormatError` if it cannot be read, is not a valid cache, or holds more than
        ``max_ngrams`` n-grams.
        """
        return cls.from_bytes(read_cache_file(path), source=os.fspath(path), max_ngrams=max_ngrams)


def _check_vocabulary(ngram_words: np.ndarray, pairs: np.ndarray, starts: np.ndarray,
                      is_pair_word: np.ndarray, n_vocab: int, source: str) -> None:
    """Raise CacheFormatError at the first token id ``>= n_vocab`` of the checked records (the
    arrays of :meth:`NgramCache.from_bytes`, step 2: the -1 padding is below any vocabulary)."""
    offsets: List[int] = []
    bad_ngram = (ngram_words >= n_vocab).any(axis=1)
    if bad_ngram.any():
        offsets.append(int(starts[int(np.argmax(bad_ngram))]))
    bad_pair = pairs[:, 0] >= n_vocab
    if bad_pair.any():
        offsets.append(int(np.flatnonzero(is_pair_word)[2 * int(np.argmax(bad_pair))]))
    if offsets:
        raise CacheFormatError(
            f"n-gram cache {source}: a token id outside this model's vocabulary of {n_vocab} tokens "
            f"at byte offset {min(offsets) * _WORD_BYTES}: the file holds tokens of another model "
            "(a static cache is built per model with gemma-spec-lookup-create)")


def read_cache_file(path: PathLike) -> bytes:
    """The bytes of the cache file ``path`` (a regular file of at most :data:`MAX_FILE_BYTES`).

    Raises :class:`CacheFileNotFoundError` if it does not exist, :class:`CacheFormatError` if it
    cannot be read (a directory, a FIFO, too large, no permission)."""
    try:
        return read_regular_file(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise CacheFileNotFoundError(
            f"n-gram cache file {os.fspath(path)} does not exist "
            "(build a static cache with gemma-spec-lookup-create)") from None
    except OSError as error:
        raise CacheFormatError(
            f"cannot read n-gram cache file {os.fspath(path)}: {error.strerror or error}") from None


#: The largest n-gram cache file read: 256 MiB holds ~10 million 2-gram records, far more than a
#: robot keeps in memory as Python objects (a 27 MiB file of 1 million n-grams took ~0.7 GiB).
MAX_FILE_BYTES = 256 << 20
