"""Suffix decoding: drafts from the longest earlier occurrence of the context's end, in the current
request and in a bounded history of earlier outputs (SuffixDecoding, Oliaro et al. 2024, arXiv
2411.04975; vLLM's ``method: "suffix"``).

A robot's planner sends the same kind of request again and again, and the text most likely to come
next is often a long stretch of an *earlier answer*. The n-gram lookup drafter (:mod:`.lookup`) sees
the last 1-4 tokens; this drafter matches up to 32 (:data:`~.suffix_index.DEFAULT_LEVELS`), so the
context that tells one skill's arguments from another's, or one file's line from another's, decides
the draft.

Each step, with ``context`` = prompt + accepted tokens:

1. the index (:class:`~.suffix_index.SuffixIndex`: the history's sequences, then this request's)
   finds the longest suffix of ``context`` that occurred before with a continuation, and its
   newest ``max_occurrences`` occurrences;
2. the draft follows them token by token: the continuation most of them share (ties: the newest),
   then only the occurrences that continue so, as a walk down a suffix tree does; the share of the
   chosen token among them is its estimated probability;
3. it stops when the product of those shares falls below ``min_token_probability``, at
   ``match_factor`` x the match length (a long match earns a long draft), or at ``max_tokens``.

Every drafted token carries its :data:`Evidence` (where its occurrences were, whether all of them
agreed), and the draft-length policy cuts each draft where the
measured acceptance of those classes says the expected gain peaks (policy.py, "Cutting each draft").

At the end of a request its output (and, with ``keep_prompts``, its prompt) joins the history; the
oldest history is evicted past ``history_max_tokens``. The history is saved to ``history_path`` in
the learned cache's folder with its file-safety rules (:mod:`.suffix_history`).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from . import learned_cache, suffix_history
from .suffix_index import DEFAULT_LEVELS, Match, SuffixIndex
from .base import EMPTY_DRAFT, Draft
from ..errors import CacheFormatError
from ..config import SamplingParams, SpecConfig, SuffixConfig, expand_path

if TYPE_CHECKING:
    import numpy as np


def index_levels(config: SuffixConfig) -> Tuple[int, ...]:
    """The index's match lengths for ``config.max_match``.

    >>> index_levels(SuffixConfig(max_match=5)), index_levels(SuffixConfig())[-1]
    ((1, 2, 3, 4), 32)
    """
    return tuple(n for n in DEFAULT_LEVELS if n <= config.max_match) or (config.max_match,)


#: Evidence of a drafted token (``Draft.evidence``): (where its occurrences were: "request" if the
#: newest one is in the current request, else "history"; all the counted occurrences continued with
#: it). The policy learns acceptance per class and position with a short memory (policy.py), so few
#: classes learn fast: replayed on the planner trace (36 requests, bench.trace_replay), these two bits
#: gave 2.88x plain where adding a match-length bucket (1, 2-3, 4-7, 8-15, 16+ tokens) and a support
#: bucket (1, 2-3, 4+ occurrences) gave 2.60x, and no evidence at all 2.76x.
Evidence = Tuple[str, bool]


def draft_with_evidence(index: SuffixIndex, context: Sequence[int], max_tokens: int,
                        config: SuffixConfig, request_start: int) -> Tuple[List[int], List[Evidence]]:
    """Up to ``max_tokens`` tokens to follow ``context`` from ``index`` (module docstring, steps
    1-3), with their evidence; positions from ``request_start`` on are the current request's.

    Worked example: the history holds "5 6 7 8" twice and "5 6 7 9" once; the context ends "5 6".
    The match is "5 6" (3 occurrences): all continue with 7 (share 1), then 8 twice, 9 once: 8
    (share 2/3). The match factor 1 bounds the draft to 2 tokens.

    >>> index = SuffixIndex(64)
    >>> for sequence in ([5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 9]):
    ...     index.new_sequence(); index.extend(sequence)
    >>> index.new_sequence(); start = index.end; index.extend([3, 5, 6])
    >>> draft_with_evidence(index, [3, 5, 6], 8, SuffixConfig(match_factor=1), start)
    ([7, 8], [('history', True), ('history', False)])

    Measured and not kept (replay of the planner trace): a second draft from the longest match in
    the current request alone, kept where it expects more tokens (2.48x plain against 2.84x: a
    request's one occurrence, the system prompt's example plan, outvoted the history's many), and
    votes of the request's occurrences counted 2 or 4 times (2.83x, 2.78x).
    """
    if max_tokens < 1 or not context:
        return [], []
    match = index.longest_match(context, config.max_occurrences, config.max_match)
    if match is None:
        return [], []
    limit = max_tokens
    if config.match_factor > 0:
        limit = min(limit, max(1, int(config.match_factor * match.length)))
    return _walk(index, match, limit, config.min_token_probability, request_start)


def _walk(index: SuffixIndex, match: Match, limit: int, min_probability: float,
          request_start: int) -> Tuple[List[int], List[Evidence]]:
    """Follow the occurrences of ``match`` down their common continuation (a suffix-tree walk)."""
    positions = list(match.positions)
    tokens: List[int] = []
    evidence: List[Evidence] = []
    probability = 1.0
    while len(tokens) < limit:
        followers = [index.follower(p) for p in positions]
        counts: Dict[int, int] = {}
        for token in followers:  # newest first: on a tie the newest continuation wins
            if token is not None:
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        support, total = counts[token], sum(counts.values())
        probability *= support / total
        if probability < min_probability:
            break
        agreeing = [p + 1 for p, f in zip(positions, followers) if f == token]
        evidence.append(("request" if agreeing[0] >= request_start else "history", support == total))
        tokens.append(token)
        positions = agreeing
    return tokens, evidence


#: Tokens at the end of the known context that each step compares with the new one.
SYNC_CHECK = 64
#: Slots of the index for the current request (prompt + output) beyond the history's cap; a longer
#: request evicts the oldest history while it runs.
REQUEST_ROOM = 8192


class SuffixDrafter:
    """The ``suffix`` drafter: drafts from the longest earlier occurrence of the context's end.

    Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`. Per request: :meth:`begin` with the
    prompt, :meth:`propose` per step (the context may only grow, except that tokens drafted ahead,
    such as a grammar's forced text, may be taken back: the index follows), :meth:`end` with the
    final tokens (the output joins the history). :meth:`close` saves the history. Not thread-safe.

    Raises :class:`~gemma_spec_ros.engine.errors.CacheFormatError` if ``history_path`` names a file
    this engine did not write or one of another vocabulary (both left untouched); a damaged one of
    its own is moved aside with a warning and the history starts empty.
    """

    name = "suffix"
    cheap_to_probe = True  # a probe is a few hash lookups
    cuts_drafts = True  # its drafts carry their evidence: the policy cuts each one (policy.py)

    def __init__(self, config: SuffixConfig, vocab_tag: str = "", request_room: int = REQUEST_ROOM) -> None:
        self.config = config
        self._vocab_tag = vocab_tag
        self._path = expand_path(config.history_path)
        self.warnings: List[str] = []
        #: a periodic save's failure not yet taken by the owner (see LookupDrafter.save_error)
        self.save_error: Optional[str] = None
        if self._path:
            learned_cache.prepare_folder(self._path, expand_path(config.cache_dir))
        self._index = SuffixIndex(config.history_max_tokens + max(1, request_room), index_levels(config))
        for sequence in self._load(self._path):
            self._index.new_sequence()
            self._index.extend(sequence)
        self._history_end = self._index.end
        self._request_start = self._history_end
        self._prompt_length = -1  # the current request's prompt tokens; -1 between requests
        self._request: List[int] = []  # the current request's tokens in the index
        self._changed = False
        self._last_save = time.monotonic()

    def _load(self, path: str) -> List[List[int]]:
        if not path:
            return []
        try:
            return suffix_history.load(path, self._vocab_tag, self.config.history_max_tokens)
        except learned_cache.CorruptLearnedCacheError as error:
            aside = learned_cache.move_aside(path)
            self.warnings.append(f"{error}; moved it to {aside} and started an empty history")
            return []

    @property
    def index(self) -> SuffixIndex:
        """The history and the current request (read-only by convention)."""
        return self._index

    @property
    def history_tokens(self) -> int:
        """Tokens of earlier requests kept (separators included)."""
        return self._history_end - self._index.start

    # --------------------------------------------------------------------------- Drafter protocol
    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional["np.random.Generator"] = None) -> None:
        """Start a request: its prompt becomes the index's newest sequence, indexed at the first
        :meth:`propose` (a request whose mode never asks this drafter costs it only its output's
        indexing, at :meth:`end`). Drafts are deterministic whatever the sampling: ``sampling`` and
        ``rng`` are not used."""
        self._drop_request()
        self._index.new_sequence()
        self._request_start = self._index.end
        self._prompt_length = len(prompt_tokens)
        self._request = []

    def _drop_request(self) -> None:
        """Take the current request out of the index (back to the history's end)."""
        if self._index.end != self._history_end:
            self._index.truncate(max(self._history_end, self._index.start))
        self._request = []

    def _sync(self, context: Sequence[int]) -> None:
        """Make the request's part of the index equal ``context``: take back what differs, then
        append what is new. Only the last :data:`SYNC_CHECK` known tokens are compared (the context
        only grows, or takes back tokens drafted ahead at its end), so a step costs O(1) whatever
        the context's length."""
        known = self._request
        same = len(known)
        if not isinstance(context, list):
            context = list(context)
        tail = max(0, same - SYNC_CHECK)
        if len(context) < same or context[tail:same] != known[tail:]:
            same = next((i for i, (a, b) in enumerate(zip(known, context)) if a != b),
                        min(len(known), len(context)))
            self._index.truncate(self._request_start + same)
            del known[same:]
        if len(context) > same:
            fresh = [int(t) for t in context[same:]]
            self._index.extend(fresh)
            known.extend(fresh)

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens to follow ``context`` (prompt + accepted tokens); the empty
        draft without a match. ``spec``'s limits are the draft model's, not used here."""
        self._sync(context)
        tokens, evidence = draft_with_evidence(self._index, context, max_tokens, self.config,
                                               self._request_start)
        if not tokens:
            return EMPTY_DRAFT
        return Draft(tokens=tuple(tokens), probs=None, source=self.name, evidence=tuple(evidence))

    def end(self, tokens: Sequence[int]) -> None:
        """The request finished with ``tokens`` (prompt + generated): its output (with
        ``keep_prompts`` all of it) joins the history, the oldest history is evicted past the cap,
        and a periodic save may run (its failure is kept in ``save_error``, never raised)."""
        self._drop_request()
        started, self._prompt_length = self._prompt_length, -1
        if started < 0:  # no begin(): the request ended before its prompt pass did (nothing to learn)
            return
        kept = list(tokens) if self.config.keep_prompts else list(tokens[started:])
        if kept and self.config.history_max_tokens > 0:
            self._index.new_sequence()
            self._index.extend(kept)
            self._changed = True
        self._index.evict_to(self.config.history_max_tokens)
        self._history_end = self._request_start = self._index.end
        period = self.config.save_period
        if period and self._changed and time.monotonic() - self._last_save >= period:
            try:
                self.save()
            except (OSError, CacheFormatError, ValueError) as error:
                self.save_error = f"saving the suffix history failed: {error}"

    def before_target_pass(self, drafting: bool) -> None:
        """Nothing: suffix drafts read no target rows."""

    def take_fault(self) -> Optional[str]:
        """A periodic save's failure since the last call (reported once), else None."""
        fault, self.save_error = self.save_error, None
        return fault

    def save(self) -> None:
        """Save the history now (atomically) if ``history_path`` is set; only over a file this
        engine wrote (ForeignFileError otherwise)."""
        self._last_save = time.monotonic()
        if self._path:
            suffix_history.save(self._index.sequences(self._history_end), self._path, self._vocab_tag)
            self._changed = False

    def warm_up(self, filler: Sequence[int], max_rows: int, passes: int) -> None:
        """Nothing to warm up: no model."""

    def model_info(self) -> Optional[dict]:
        return None

    def for_slot(self, seq: int) -> "SuffixDrafter":
        """A suffix drafter for another request at the same time: its index holds its own
        requests and the history they leave, in memory (this drafter's history is not shared:
        the index holds one running request at its end)."""
        return SuffixDrafter(replace(self.config, history_path="", cache_dir=""),
                             request_room=self._index.capacity - self.config.history_max_tokens)

    def close(self) -> None:
        """Save the history if it changed since it was loaded or saved, or if its file does not
        exist yet. Safe to call more than once."""
        if self._path and (self._changed or not Path(self._path).exists()):
            self.save()
