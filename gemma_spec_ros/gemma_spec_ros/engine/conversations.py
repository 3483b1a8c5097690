"""Recent conversations' KV, kept in host memory, so that a follow-up turn evaluates only what is new.

One planner talking to the node needs nothing of this: the target's KV cache still holds its last
turn (prompt + reply), and prompt reuse keeps the common prefix. Several planners (or a planner with
several conversations) take turns, and each turn would find another conversation's KV. So once a
turn's prompt is decoded, the sequence's state is copied out (llama.cpp's ``llama_state_seq_get_data``:
the KV cells of the request's sequence, ~9.4 KiB a token for Gemma 3 270M) and kept under its tokens; when a turn
starts, the snapshot whose tokens share the longest prefix with the new prompt is copied back in
(``llama_state_seq_set_data``, into whichever sequence the turn runs in: several requests at once
each have one) if it shares more than what the sequence holds now. The store keeps at
most ``max_bytes`` of snapshots and drops the least recently used first.

Why snapshots, not a KV sequence per conversation: llama.cpp's sequences share one cache of n_ctx
cells, so N conversations would each get 1/N of the context, and a fixed N; a snapshot costs a copy
(~15-40 ms for 700 tokens of the 270M model on 2 busy cores, against ~30 s to evaluate them again
there) and bounds memory by bytes. A restored cache gives the same positions and values; the cells
of the sliding-window layers may be laid out otherwise than before, so with the full-window cache
(F16/F32 weights) logits can differ by float rounding (measured max |d logit| 0.016), as after a
window cache's rollback; the window cache (quantized weights) came back bit-identical.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple


@dataclass
class Snapshot:
    tokens: Tuple[int, ...]
    data: Any  # a ctypes byte array llama.cpp filled
    size: int
    first: int = 0  # the lowest position its sliding-window cells hold (LlamaModel.saved_window_start)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two token sequences.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5]), common_prefix([], [1])
    (2, 0)
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ConversationCache:
    """Snapshots of a sequence's KV by the tokens they hold, at most ``max_bytes``, LRU.

    A backend is the target (its sequence 0) or one sequence of it (llama/model.py SequenceView):
    ``seq``, ``kv_tokens`` (settable), ``clear()``, ``handles``, and what the sliding window keeps
    (``saved_window_start()``, ``window_kept(first, n)``, ``reusable_prefix(tokens, keep_last=)``).

    A snapshot holds a sliding-window layer's cells only for the positions the sequence's window
    still saw when it was taken (llama.cpp's ``llama_state_seq_get_data`` leaves the others out),
    so a snapshot longer than the window serves only a prompt that keeps it whole: restored and
    cut shorter, the next tokens would attend without the positions it left out. A chat turn is
    therefore kept as its prompt, right after the prompt pass (the conversation's next turn starts
    with that prompt, whatever the template makes of the reply), and a snapshot is restored only
    where the window of the prefix it keeps is in it.

    ``min_gain``: a snapshot is restored only if it shares at least this many more tokens with the
    prompt than the cache's own content does (a copy is not free). Thread-safe; the backend is used
    only from the generation thread (like every decode).
    """

    def __init__(self, max_bytes: int, min_gain: int = 32) -> None:
        self.max_bytes = max_bytes
        self.min_gain = min_gain
        self._snapshots: "OrderedDict[Tuple[int, ...], Snapshot]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.restored = 0  # snapshots copied back in (for /diagnostics)
        self.saved = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._snapshots)

    def save(self, backend: Any) -> bool:
        """Keep what the backend's cache holds now (a turn's prompt was decoded); False if it does
        not fit, or the copy failed (a snapshot saves time, it is never needed: a failure to make
        one, a MemoryError included, leaves the request and the store as they were)."""
        tokens = tuple(backend.kv_tokens)
        if not tokens or self.max_bytes <= 0:
            return False
        try:
            size = backend.state_size()
            if size > self.max_bytes:
                return False
            data, written = backend.save_state(size)
        except (MemoryError, OSError):
            return False
        if written <= 0:
            return False
        with self._lock:
            self._drop_covered(tokens)
            self._snapshots[tokens] = Snapshot(tokens, data, written, backend.saved_window_start())
            self._bytes += written
            self.saved += 1
            while self._bytes > self.max_bytes and self._snapshots:
                _, old = self._snapshots.popitem(last=False)
                self._bytes -= old.size
        return True

    def _drop_covered(self, tokens: Tuple[int, ...]) -> None:
        """Snapshots the new one covers go: those it extends (the same conversation, earlier), and
        those that leave it less than ``min_gain`` tokens before their end (the conversation's
        previous turn, whose last reply tokens the template wrote back otherwise). For any prompt
        such a snapshot would serve at most ``min_gain`` tokens more than the new one, and a
        restore needs more than that."""
        for key in [k for k in self._snapshots if len(k) - common_prefix(k, tokens) <= self.min_gain]:
            self._bytes -= self._snapshots.pop(key).size

    def best(self, prompt: Sequence[int], backend: Any) -> Tuple[Optional[Snapshot], int]:
        """The snapshot that serves the longest prefix of ``prompt`` (its last token is decoded
        again, as prompt reuse does), and that length: the prefix it shares with the prompt, where
        the backend's sliding window of that prefix is in it."""
        limit = len(prompt) - 1
        with self._lock:
            snapshots = list(self._snapshots.values())
        scored = []
        for snapshot in snapshots:
            kept = min(common_prefix(snapshot.tokens, prompt), limit)
            if kept < len(snapshot.tokens) and not backend.window_kept(snapshot.first, kept):
                kept = 0
            scored.append((kept, snapshot))
        if not scored:
            return None, 0
        length, snapshot = max(scored, key=lambda pair: pair[0])
        return snapshot, length

    def restore_for(self, backend: Any, prompt: Sequence[int]) -> int:
        """Copy back in the snapshot that serves ``prompt`` best, if it serves ``min_gain`` tokens
        more than the cache does now; returns the prompt tokens it serves (0: nothing restored).
        The backend's ``kv_tokens`` then say what its cache holds; prompt reuse does the rest."""
        snapshot, length = self.best(prompt, backend)
        here = backend.reusable_prefix(prompt, keep_last=1)
        if snapshot is None or length < here + self.min_gain:
            return 0
        backend.clear()
        if not backend.load_state(snapshot.data, snapshot.size):
            backend.clear()  # nothing trustworthy is left: evaluate the prompt afresh
            return 0
        backend.kv_tokens = list(snapshot.tokens)
        with self._lock:
            if snapshot.tokens in self._snapshots:
                self._snapshots.move_to_end(snapshot.tokens)
            self.restored += 1
        return length

    def clear(self) -> None:
        with self._lock:
            self._snapshots.clear()
            self._bytes = 0

    def keys(self) -> List[Tuple[int, ...]]:
        with self._lock:
            return list(self._snapshots)


__all__ = ["ConversationCache", "common_prefix"]
