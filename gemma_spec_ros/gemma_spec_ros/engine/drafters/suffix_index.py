"""A bounded index of token sequences that finds where the end of a context occurred before, and what
followed it there: the memory of the suffix drafter (:mod:`.suffix`).

A suffix tree answers "the longest suffix of the context seen before, and its continuations by
frequency" in O(match length), but a Python node per token and depth costs hundreds of bytes. This
index answers the same question at a fixed set of match lengths (:data:`DEFAULT_LEVELS`) with flat
arrays and no Python object per token, the hash chains of LZ77 compressors:

- tokens live in a ring of ``capacity`` slots; positions are absolute and only grow; a position is
  *live* while it is among the last ``capacity`` appended (older ones are overwritten: the oldest
  tokens are evicted first, and :meth:`SuffixIndex.evict_to` evicts more);
- for each level n and each position p whose last n tokens lie in one sequence, ``keys[n][p]`` is
  the hash of those n tokens and ``prev[n][p]`` the previous position whose n-gram fell in the same
  bucket; ``heads[n][bucket]`` is the newest. A chain visits the occurrences of an n-gram newest
  first and stops at the first dead position (chains only go back in time), so eviction costs
  nothing: positions older than :attr:`SuffixIndex.start` are simply never read.

Sequences (an earlier output, the current request) are separated by :data:`SEPARATOR`: no n-gram
spans two of them and no continuation runs from one into the next.

Costs: :meth:`~SuffixIndex.extend` O(levels) per token; :meth:`~SuffixIndex.truncate` O(levels) per
token removed (it undoes appends exactly, newest first); :meth:`~SuffixIndex.longest_match` one hash
and one chain walk of at most ``limit`` occurrences per level tried. Memory: 16 bytes per slot and
8 per bucket for each level, 8 per slot for the tokens.

>>> index = SuffixIndex(capacity=64)
>>> index.extend([5, 6, 7, 8, 1, 5, 6, 7, 9])
>>> match = index.longest_match([2, 5, 6, 7], limit=8)
>>> match.length, [index.follower(p) for p in match.positions]   # newest first: "5 6 7" -> 9, -> 8
(3, [9, 8])
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

#: Match lengths the index can tell apart (an n-gram table each). Deeper levels cost memory and
#: an append a hash each; a match between two levels counts as the shorter.
DEFAULT_LEVELS: Tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
#: Ends a sequence in the ring: never a token id.
SEPARATOR = -1
#: ``prev`` of a position whose n-gram at that level spans a sequence start (not in the chain).
_NOT_INDEXED = -2
_NO_POSITION = -1
#: A chain walk reads at most ``_WALK_FACTOR * limit + _WALK_SLACK`` positions: a bucket also holds
#: other n-grams (about one per bucket: there are as many buckets as slots) and sequence ends.
_WALK_FACTOR, _WALK_SLACK = 4, 16


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context (among the index's levels) that occurred before with a
    continuation: its length and the end positions of those occurrences, newest first."""

    length: int
    positions: Tuple[int, ...]


class SuffixIndex:
    """Token sequences in a ring with an n-gram hash chain per level (module docstring).

    Not thread-safe. ``levels`` must be increasing positive integers.
    """

    def __init__(self, capacity: int, levels: Sequence[int] = DEFAULT_LEVELS) -> None:
        if capacity < 1:
            raise ValueError(f"suffix index capacity {capacity}: must be >= 1 token")
        if not levels or list(levels) != sorted(set(levels)) or levels[0] < 1:
            raise ValueError(f"suffix index levels {tuple(levels)}: need increasing lengths >= 1")
        self.capacity = capacity
        self.levels = tuple(int(n) for n in levels)
        self._level_of = {n: level for level, n in enumerate(self.levels)}
        buckets = 1 << max(1, (capacity - 1).bit_length())
        self._mask = buckets - 1
        self._tokens = array("q", [SEPARATOR]) * capacity
        self._heads = [array("q", [_NO_POSITION]) * buckets for _ in self.levels]
        self._prev = [array("q", [_NOT_INDEXED]) * capacity for _ in self.levels]
        self._keys = [array("q", [0]) * capacity for _ in self.levels]
        self._start = 0  # oldest live position
        self._end = 0  # next position
        self._sequence_starts: List[int] = [0]  # first position of each live sequence, ascending
        self._recent: List[int] = []  # the current sequence's last max(levels) tokens

    # ----------------------------------------------------------------------------------- state
    @property
    def start(self) -> int:
        """The oldest live position."""
        return self._start

    @property
    def end(self) -> int:
        """The position the next token gets (live positions are ``start .. end - 1``)."""
        return self._end

    @property
    def sequence_start(self) -> int:
        """The first position of the current (last) sequence."""
        return self._sequence_starts[-1]

    def __len__(self) -> int:
        """Live slots, separators included."""
        return self._end - self._start

    def token(self, position: int) -> int:
        """The token at a live ``position`` (:data:`SEPARATOR` between sequences)."""
        if not self._start <= position < self._end:
            raise IndexError(f"position {position} is not live ({self._start}..{self._end - 1})")
        return self._tokens[position % self.capacity]

    def follower(self, position: int) -> Optional[int]:
        """The token after ``position`` in its sequence; None at a sequence's (or the index's) end."""
        nxt = position + 1
        if nxt >= self._end or nxt < self._start:
            return None
        token = self._tokens[nxt % self.capacity]
        return None if token == SEPARATOR else token

    def sequences(self, end: Optional[int] = None) -> List[List[int]]:
        """The live tokens before ``end`` (default: all) split into sequences, oldest first (the
        oldest may have lost its start to eviction); empty sequences are left out."""
        out: List[List[int]] = []
        current: List[int] = []
        for position in range(self._start, self._end if end is None else min(end, self._end)):
            token = self._tokens[position % self.capacity]
            if token == SEPARATOR:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
        if current:
            out.append(current)
        return out

    # ---------------------------------------------------------------------------------- writing
    def new_sequence(self) -> None:
        """Tokens appended from now on form a new sequence (a separator ends the current one)."""
        if self._end > self.sequence_start:  # the current one holds tokens: close it
            self._append_slot(SEPARATOR)
            self._sequence_starts.append(self._end)
        self._recent = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (ids >= 0) to the current sequence, evicting the oldest if full."""
        top = self.levels[-1]
        recent = self._recent
        for token in tokens:
            token = int(token)
            if token < 0:
                raise ValueError(f"token id {token}: must be >= 0")
            position = self._end
            self._append_slot(token)
            recent.append(token)
            if len(recent) > top:
                del recent[0]
            tail = tuple(recent)
            slot = position % self.capacity
            for level, n in enumerate(self.levels):
                if n > len(tail):
                    break
                key = hash(tail[-n:])
                bucket = key & self._mask
                self._keys[level][slot] = key
                self._prev[level][slot] = self._heads[level][bucket]
                self._heads[level][bucket] = position

    def _append_slot(self, token: int) -> None:
        """Write ``token`` at the end, first evicting the oldest slot if the ring is full."""
        if self._end - self._start >= self.capacity:
            self._evict_oldest(self._end - self.capacity + 1)
        slot = self._end % self.capacity
        self._tokens[slot] = token
        for prev in self._prev:
            prev[slot] = _NOT_INDEXED
        self._end += 1

    def _evict_oldest(self, new_start: int) -> None:
        self._start = max(self._start, new_start)
        starts = self._sequence_starts
        while len(starts) > 1 and starts[1] <= self._start:
            del starts[0]

    def evict_to(self, max_tokens: int) -> None:
        """Keep at most the newest ``max_tokens`` slots (the older ones become dead, in O(1))."""
        if self._end - self._start > max_tokens:
            self._evict_oldest(self._end - max(0, max_tokens))

    def truncate(self, end: int) -> None:
        """Remove every position from ``end`` on (``start <= end <= self.end``), undoing the
        appends newest first so that the chains are as they were before them."""
        if not self._start <= end <= self._end:
            raise ValueError(f"truncate to {end}: outside the live positions {self._start}..{self._end}")
        for position in range(self._end - 1, end - 1, -1):
            slot = position % self.capacity
            for level in range(len(self.levels)):
                prev = self._prev[level][slot]
                if prev == _NOT_INDEXED:
                    continue
                bucket = self._keys[level][slot] & self._mask
                if self._heads[level][bucket] == position:
                    self._heads[level][bucket] = prev
        self._end = end
        starts = self._sequence_starts
        while len(starts) > 1 and starts[-1] > end:
            del starts[-1]
        first = max(self.sequence_start, end - self.levels[-1], self._start)
        self._recent = [self._tokens[p % self.capacity] for p in range(first, end)]

    # ---------------------------------------------------------------------------------- reading
    def occurrences(self, ngram: Sequence[int], limit: int) -> List[int]:
        """End positions of the newest (at most ``limit``) earlier occurrences of ``ngram`` (its
        length one of the levels) that are followed by a token of their sequence, newest first."""
        level = self._level_of[len(ngram)]
        key = hash(tuple(map(int, ngram)))
        keys, prev, tokens, capacity = self._keys[level], self._prev[level], self._tokens, self.capacity
        start, last = self._start, self._end - 1  # a position at ``last`` has no follower
        position = self._heads[level][key & self._mask]
        found: List[int] = []
        steps = _WALK_FACTOR * limit + _WALK_SLACK  # other n-grams of the bucket, sequence ends
        while position >= start and len(found) < limit and steps > 0:
            slot = position % capacity
            # inline follower(): the next slot is live and holds a token, not a separator
            if keys[slot] == key and position < last and tokens[(position + 1) % capacity] != SEPARATOR:
                found.append(position)
            position = prev[slot]
            steps -= 1
        return found

    def longest_match(self, context: Sequence[int], limit: int,
                      max_length: Optional[int] = None) -> Optional[Match]:
        """The longest suffix of ``context`` among the levels (at most ``max_length`` tokens) that
        occurred before with a continuation, with the newest ``limit`` such occurrences; None if
        not even its last token did.

        ``context`` may itself be the index's current sequence: its own last n-gram ends the index
        and has no continuation, so it never counts.
        """
        return longest_match(self, context, limit, max_length)

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """How many first tokens of the current sequence equal those of ``tokens`` (the current
        sequence must still hold its first token: not evicted)."""
        first = self.sequence_start
        n = min(self._end - first, len(tokens))
        capacity, stored = self.capacity, self._tokens
        for i in range(n):
            if stored[(first + i) % capacity] != tokens[i]:
                return i
        return n


def longest_match(index: "SuffixIndex | IndexPair", context: Sequence[int], limit: int,
                  max_length: Optional[int] = None) -> Optional[Match]:
    """:meth:`SuffixIndex.longest_match` of ``index`` (one index, or a pair of them)."""
    for n in reversed(index.levels):
        if n > len(context) or (max_length is not None and n > max_length):
            continue
        positions = index.occurrences(context[len(context) - n:], limit)
        if positions:
            return Match(n, tuple(positions))
    return None


#: Added to a position of the request's index in an :class:`IndexPair` (the history's are below it).
REQUEST_POSITIONS = 1 << 62


class IndexPair:
    """The current request's index and the shared history's, read as one: the request's occurrences
    first (the newest: its text follows everything the history holds), then the history's.

    A request's index holds one sequence, its prompt and output, and is the request's own; the
    history's sequences are shared by every request. So each request can keep its index (and the
    next request with the same long system prompt reuses most of it) while the history only grows
    by outputs at the end of requests. A request's positions are offset by
    :data:`REQUEST_POSITIONS`: :meth:`in_request` tells them apart.

    >>> history, request = SuffixIndex(64), SuffixIndex(64)
    >>> history.extend([5, 6, 7, 8]); request.extend([5, 6, 9, 1, 5, 6])
    >>> pair = IndexPair(request, history)
    >>> match = pair.longest_match([1, 5, 6], 8)
    >>> match.length, [pair.follower(p) for p in match.positions], [pair.in_request(p) for p in match.positions]
    (2, [9, 7], [True, False])
    """

    def __init__(self, request: SuffixIndex, history: SuffixIndex) -> None:
        if request.levels != history.levels:
            raise ValueError(f"index levels differ: request {request.levels}, history {history.levels}")
        self.request, self.history = request, history
        self.levels = history.levels

    @staticmethod
    def in_request(position: int) -> bool:
        return position >= REQUEST_POSITIONS

    def follower(self, position: int) -> Optional[int]:
        """The token after ``position`` in its sequence (SuffixIndex.follower of its index)."""
        if position >= REQUEST_POSITIONS:
            return self.request.follower(position - REQUEST_POSITIONS)
        return self.history.follower(position)

    def occurrences(self, ngram: Sequence[int], limit: int) -> List[int]:
        """The newest ``limit`` occurrences of ``ngram`` with a continuation: the request's, then
        the history's (SuffixIndex.occurrences)."""
        found = [REQUEST_POSITIONS + p for p in self.request.occurrences(ngram, limit)]
        if len(found) < limit:
            found.extend(self.history.occurrences(ngram, limit - len(found)))
        return found

    def longest_match(self, context: Sequence[int], limit: int,
                      max_length: Optional[int] = None) -> Optional[Match]:
        """:meth:`SuffixIndex.longest_match` over both indexes."""
        return longest_match(self, context, limit, max_length)
