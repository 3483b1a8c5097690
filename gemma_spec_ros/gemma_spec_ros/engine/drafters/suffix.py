"""Suffix decoding: drafts from the longest earlier occurrence of the context's end, in the current
request and in a bounded history of earlier outputs (SuffixDecoding, Oliaro et al. 2024, arXiv
2411.04975; vLLM's ``method: "suffix"``).

A robot's planner sends the same kind of request again and again, and the text most likely to come
next is often a long stretch of an *earlier answer*. The n-gram lookup drafter (:mod:`.lookup`) sees
the last 1-4 tokens; this drafter matches up to 32 (:data:`~.suffix_index.DEFAULT_LEVELS`), so the
context that tells one skill's arguments from another's, or one file's line from another's, decides
the draft.

Each step, with ``context`` = prompt + accepted tokens:

1. the indexes (:class:`~.suffix_index.IndexPair`: this request's own :class:`RequestIndex`, then
   the history's :class:`~.suffix_index.SuffixIndex`, shared by every request) find the longest
   suffix of ``context`` that occurred before with a continuation, and its newest
   ``max_occurrences`` occurrences;
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

import copy
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from . import learned_cache, suffix_history
from .suffix_index import DEFAULT_LEVELS, IndexPair, Match, SuffixIndex
from .base import EMPTY_DRAFT, Draft, Drafter
from .saved_state import SavedState
from ..config import EngineConfig, SamplingParams, SpecConfig, SuffixConfig, expand_path

if TYPE_CHECKING:
    import numpy as np

    from ..llama.model import LlamaModel


def index_levels(config: SuffixConfig) -> Tuple[int, ...]:
    """The index's match lengths for ``config.max_match``.

    >>> index_levels(SuffixConfig(max_match=5)), index_levels(SuffixConfig())[-1]
    ((1, 2, 3, 4), 32)
    """
    return tuple(n for n in DEFAULT_LEVELS if n <= config.max_match) or (config.max_match,)


#: Evidence of a drafted token (``Draft.evidence``): (where its occurrences were: "request" if the
#: newest one is in the current request, else "history"; all the counted occurrences continued with
#: it; at least two of them did; the short context agrees: the newest :data:`SHORT_OCCURRENCES`
#: occurrences of the :data:`SHORT_CONTEXT` tokens before it, anywhere, all continued with it).
#: The last bit tells structure from content: a long match can be unanimous because it occurred
#: once, but where the two tokens before a value (``"place": "``) were followed by many values, the
#: history's one is a guess. Tokens of the embedded model's planner trace (oracle steps, after the
#: first five requests): unanimous history tokens were right 99.9 % of the time with the short
#: context agreeing (1,134 tokens) against 94 % without (1,210). Replayed (bench.trace_replay, the
#: planner trace, pass costs fitted on its timed run), median speedup over plain: 1.53x with the
#: first two bits, 1.62x with all four (the policy's evidence model pools sparse classes,
#: policy/acceptance.py); where and unanimity alone were chosen when every row was modelled 3x
#: cheaper, where a match-length and a support bucket had cost 10 % (2.60x against 2.88x).
Evidence = Tuple[str, bool, bool, bool]
#: Tokens before a drafted one whose other occurrences are checked (the evidence's last bit).
SHORT_CONTEXT = 2
#: The newest occurrences of those tokens that must all have continued with the drafted one.
SHORT_OCCURRENCES = 8


def draft_with_evidence(index: IndexPair, context: Sequence[int], max_tokens: int,
                        config: SuffixConfig) -> Tuple[List[int], List[Evidence]]:
    """Up to ``max_tokens`` tokens to follow ``context`` from ``index`` (the request's and the
    history's: module docstring, steps 1-3), with their evidence.

    Worked example: the history holds "5 6 7 8" twice and "5 6 7 9" once; the context ends "5 6".
    The match is "5 6" (3 occurrences): all continue with 7 (share 1), then 8 twice, 9 once: 8
    (share 2/3). The match factor 1 bounds the draft to 2 tokens.

    >>> history, request = SuffixIndex(64), SuffixIndex(64)
    >>> for sequence in ([5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 9]):
    ...     history.new_sequence(); history.extend(sequence)
    >>> request.extend([3, 5, 6])
    >>> draft_with_evidence(IndexPair(request, history), [3, 5, 6], 8, SuffixConfig(match_factor=1))
    ([7, 8], [('history', True, True, True), ('history', False, True, False)])

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
    return _walk(index, match, limit, config.min_token_probability, list(context[-SHORT_CONTEXT:]))


def _walk(index: IndexPair, match: Match, limit: int, min_probability: float,
          tail: List[int]) -> Tuple[List[int], List[Evidence]]:
    """Follow the occurrences of ``match`` down their common continuation (a suffix-tree walk);
    ``tail``: the context's last :data:`SHORT_CONTEXT` tokens (extended by the draft)."""
    positions = list(match.positions)
    follower = index.follower
    tokens: List[int] = []
    evidence: List[Evidence] = []
    probability = 1.0
    while len(tokens) < limit:
        followers = [follower(p) for p in positions]
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
        evidence.append(("request" if index.in_request(agreeing[0]) else "history", support == total,
                         support >= 2, _short_context_agrees(index, tail[-SHORT_CONTEXT:], token)))
        tokens.append(token)
        tail.append(token)
        positions = agreeing
    return tokens, evidence


def _short_context_agrees(index: IndexPair, ngram: List[int], token: int) -> bool:
    """Whether the newest :data:`SHORT_OCCURRENCES` occurrences of ``ngram`` (at least one) all
    continued with ``token``."""
    if len(ngram) < SHORT_CONTEXT or SHORT_CONTEXT not in index.levels:  # a max_match of 1: no such table
        return False
    positions = index.occurrences(ngram, SHORT_OCCURRENCES)
    return bool(positions) and all(index.follower(p) == token for p in positions)


class RequestIndex:
    """One request's text (prompt + accepted tokens, and tokens drafted ahead that a later step may
    take back), indexed: the request's own side of the suffix drafter's :class:`IndexPair`.

    It is kept after the request ends: the next request's context is compared with it and only
    what differs is taken back (a planner resends one long system prompt: its tokens stay indexed).
    """

    def __init__(self, capacity: int, levels: Sequence[int]) -> None:
        self.index = SuffixIndex(capacity, levels)
        self.tokens: List[int] = []  # what the index holds, position i = token i (unless evicted)

    def sync(self, context: Sequence[int], whole: bool = False) -> None:
        """Make the index hold ``context``: take back what differs, then append what is new.

        Only the last :data:`SYNC_CHECK` known tokens are compared unless ``whole`` (a step's
        context only grows, or takes back tokens drafted ahead at its end: a step costs O(1)
        whatever the context's length); the first step of a request compares all of them."""
        known = self.tokens
        if not isinstance(context, list):
            context = list(context)
        same = len(known)
        tail = 0 if whole else max(0, same - SYNC_CHECK)
        if len(context) < same or context[tail:same] != known[tail:]:
            same = _common_prefix(known, context)
            if same < self.index.start:  # the ring lost that token: index the context anew
                self.index = SuffixIndex(self.index.capacity, self.index.levels)
                known.clear()
                same = 0
            else:
                self.index.truncate(same)
                del known[same:]
        if len(context) > same:
            fresh = [int(t) for t in context[same:]]
            self.index.extend(fresh)
            known.extend(fresh)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (compared in C, a block at a time).

    >>> _common_prefix([1, 2, 3, 4], [1, 2, 5]), _common_prefix([1, 2], [1, 2, 3])
    (2, 2)
    """
    n, block, same = min(len(a), len(b)), 256, 0
    while same + block <= n and a[same:same + block] == b[same:same + block]:
        same += block
    while same < n and a[same] == b[same]:
        same += 1
    return same


#: Tokens at the end of the known context that each step compares with the new one.
SYNC_CHECK = 64
#: Slots of a request's index (prompt + output); a longer request keeps its newest tokens indexed.
REQUEST_ROOM = 8192


class SuffixDrafter(Drafter):
    """The ``suffix`` drafter: drafts from the longest earlier occurrence of the context's end.

    Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`. Per request: :meth:`begin` with the
    prompt, :meth:`propose` per step (the context may only grow, except that tokens drafted ahead,
    such as a grammar's forced text, may be taken back: the index follows), :meth:`end` with the
    final tokens (the output joins the history). :meth:`close` saves the history. Not thread-safe.

    Raises :class:`~gemma_spec_ros.engine.errors.CacheFormatError` if ``history_path`` names a file
    this engine did not write or one of another vocabulary (both left untouched); a damaged one of
    its own (a token id outside the vocabulary included) is moved aside with a warning and the
    history starts empty.

    ``n_vocab``: the target's vocabulary size (default: the one ``vocab_tag`` names, else unknown).
    No draft holds a token id outside ``[0, n_vocab)``: the first one ends it (llama.cpp refuses a
    batch with such an id whole, so the step, and the request, would fail).
    """

    name = "suffix"
    cheap_to_probe = True  # a probe is a few hash lookups
    cuts_drafts = True  # its drafts carry their evidence: the policy cuts each one (policy.py)
    #: under a grammar too. Replayed (planner trace with the plan schema, bench.trace_replay), median
    #: speedup over constrained plain decoding: 1.60x both ways with the trace's fitted pass costs,
    #: 1.94x -> 2.02x with design.md's decode shape
    cuts_constrained_drafts = True

    def __init__(self, config: SuffixConfig, vocab_tag: str = "", request_room: int = REQUEST_ROOM,
                 n_vocab: Optional[int] = None) -> None:
        self.config = config
        self._vocab_tag = vocab_tag
        #: token ids a draft may hold are below it (None: unknown, no bound)
        self.n_vocab = n_vocab if n_vocab is not None else learned_cache.tag_vocab_size(vocab_tag)
        self._path = expand_path(config.history_path)
        self.warnings: List[str] = []
        if self._path:
            learned_cache.prepare_folder(self._path, expand_path(config.cache_dir))
        levels = index_levels(config)
        self._history = SuffixIndex(max(1, config.history_max_tokens), levels)
        for sequence in self._load(self._path):
            self._history.new_sequence()
            self._history.extend(sequence)
        self._history.evict_to(config.history_max_tokens)
        self._request = RequestIndex(max(1, request_room), levels)
        self._pair = IndexPair(self._request.index, self._history)
        self._prompt_length = -1  # the current request's prompt tokens; -1 between requests
        self._synced = False  # the current request's first step compared its whole context
        #: the history's file: changed since saved, the periodic save, a failed save
        self.saved = SavedState(self._path, config.save_period, self._write, "the suffix history")
        self._owns_saved = True  # for_slot's drafters share their owner's, which saves it

    def _load(self, path: str) -> List[List[int]]:
        if not path:
            return []
        try:
            return suffix_history.load(path, self._vocab_tag, self.config.history_max_tokens, self.n_vocab)
        except learned_cache.CorruptLearnedCacheError as error:
            aside = learned_cache.move_aside(path)
            self.warnings.append(f"{error}; moved it to {aside} and started an empty history")
            return []

    @property
    def index(self) -> SuffixIndex:
        """The history of earlier requests (read-only by convention)."""
        return self._history

    @property
    def request_index(self) -> SuffixIndex:
        """The current (or last) request's text as indexed (read-only by convention)."""
        return self._request.index

    @property
    def history_tokens(self) -> int:
        """Tokens of earlier requests kept (separators included)."""
        return len(self._history)

    # ------------------------------------------------------------------------------------ Drafter
    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional["np.random.Generator"] = None) -> None:
        """Start a request. Its prompt is indexed at the first :meth:`propose`, where the request's
        index keeps what it shares with the last request's text (a request whose mode never asks
        this drafter costs it only its output's indexing, at :meth:`end`). Drafts are deterministic
        whatever the sampling: ``sampling`` and ``rng`` are not used."""
        self._prompt_length = len(prompt_tokens)
        self._synced = False

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens to follow ``context`` (prompt + accepted tokens); the empty
        draft without a match. ``spec``'s limits are the draft model's, not used here."""
        self._request.sync(context, whole=not self._synced)
        self._synced = True
        tokens, evidence = draft_with_evidence(self._pair, context, max_tokens, self.config)
        keep = learned_cache.in_vocabulary(tokens, self.n_vocab)  # never an id the target lacks
        tokens, evidence = tokens[:keep], evidence[:keep]
        if not tokens:
            return EMPTY_DRAFT
        return Draft(tokens=tuple(tokens), probs=None, source=self.name, evidence=tuple(evidence))

    def end(self, tokens: Sequence[int]) -> None:
        """The request finished with ``tokens`` (prompt + generated): its output (with
        ``keep_prompts`` all of it) joins the history, the oldest history is evicted past the cap,
        and a periodic save may run (its failure is kept in ``save_error``, never raised)."""
        started, self._prompt_length = self._prompt_length, -1
        self._synced = False
        if started < 0:  # no begin(): the request ended before its prompt pass did (nothing to learn)
            return
        kept = list(tokens) if self.config.keep_prompts else list(tokens[started:])
        if kept and self.config.history_max_tokens > 0:
            self._history.new_sequence()
            self._history.extend(kept)
            self.saved.learned()
        self._history.evict_to(self.config.history_max_tokens)
        self.saved.save_if_due()

    def take_fault(self) -> Optional[str]:
        """A periodic save's failure since the last call (reported once), else None."""
        return self.saved.take_fault()

    def save(self) -> None:
        """Save the history now (atomically) if ``history_path`` is set; only over a file this
        engine wrote (ForeignFileError otherwise)."""
        self.saved.save()

    def _write(self) -> None:
        suffix_history.save(self._history.sequences(), self._path, self._vocab_tag)

    def for_slot(self, seq: int) -> "SuffixDrafter":
        """A drafter for another request at the same time: a request index of its own over this
        drafter's history, which what its requests leave joins at once (every slot drafts from
        it); this drafter saves it."""
        other = copy.copy(self)
        other.warnings = []
        other._request = RequestIndex(self._request.index.capacity, self._request.index.levels)
        other._pair = IndexPair(other._request.index, self._history)
        other._prompt_length, other._synced, other._owns_saved = -1, False, False
        return other

    def close(self) -> None:
        """Save the history if it changed since it was loaded or saved, or if its file does not
        exist yet; a for_slot drafter leaves that to its owner. Safe to call more than once."""
        if self._owns_saved:
            self.saved.close()


def build(config: EngineConfig, target: "LlamaModel", n_seq: int) -> "SuffixDrafter":
    """The kind's builder (``engine/drafter_kinds.py``): its history learns in every mode; it
    drafts in its modes' steps."""
    suffix = config.suffix
    tag = target.vocab_tag() if suffix.history_path else ""
    return SuffixDrafter(suffix, vocab_tag=tag, request_room=config.target.n_ctx, n_vocab=target.n_vocab)
