"""Lookup decoding ("lookahead cache"): drafts from n-gram statistics, no draft model.

A reimplementation of llama.cpp's lookup decoding (``examples/lookup``,
``common_ngram_cache_draft``) over :class:`~gemma_spec_ros.engine.drafters.ngram_cache.NgramCache`,
with its three caches:

- **context** cache: n-grams of the current request (prompt + accepted tokens), rebuilt per request;
- **dynamic** cache: n-grams of earlier requests, merged in at the end of each request and saved
  to ``LookupConfig.dynamic_path`` on :meth:`LookupDrafter.close`;
- **static** cache: 2-grams of a corpus, built offline by ``gemma-spec-lookup-create`` (or
  llama.cpp's ``llama-lookup-create``), read-only. Besides drafting on its own it *weights* the
  choice among the context and dynamic caches' continuations.

Glossary: a *continuation* of an n-gram is a token that followed it; its *count* is how often;
the *sample size* is the sum of the counts of all continuations of that n-gram.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from . import learned_cache
from .ngram_cache import NGRAM_MAX, NGRAM_STATIC, NgramCache
from .base import EMPTY_DRAFT, Draft, Drafter
from .saved_state import SavedState
from ..config import EngineConfig, LookupConfig, SamplingParams, SpecConfig, expand_path

if TYPE_CHECKING:
    import numpy as np

    from ..llama.model import LlamaModel


@dataclass(frozen=True)
class DraftThresholds:
    """When a cache's most likely continuation of an n-gram may be drafted (index = size - 1)."""

    min_sample_size: Tuple[int, int, int, int]  # the n-gram must have been followed this often
    min_percent: Tuple[int, int, int, int]  # the continuation's share of those, in percent

    def accepts(self, ngram_size: int, count: int, sample_size: int) -> bool:
        """Whether a continuation seen ``count`` times out of ``sample_size`` qualifies."""
        index = ngram_size - 1
        return (sample_size >= self.min_sample_size[index]
                and 100 * count >= self.min_percent[index] * sample_size)


#: llama.cpp's ``draft_min_*_lax``: the context cache, and the static cache alone (at size 2).
LAX_THRESHOLDS = DraftThresholds(min_sample_size=(2, 2, 1, 1), min_percent=(66, 50, 50, 50))
#: llama.cpp's ``draft_min_*_strict``: the dynamic cache (other requests are weaker evidence).
STRICT_THRESHOLDS = DraftThresholds(min_sample_size=(4, 3, 2, 2), min_percent=(75, 66, 66, 66))
#: A continuation the static cache also knows weighs ``100 * static count``; an unknown one 1.
STATIC_WEIGHT_SCALE = 100


def _most_likely_continuation(continuations: Dict[int, int],
                              static_counts: Dict[int, int]) -> int:
    """The continuation with the largest ``count * static weight``.

    Ties go to the continuation inserted last (first seen most recently, or last in the file),
    which is the order llama.cpp's ``std::unordered_map`` (libstdc++) iterates in: with this rule
    our drafts reproduced ``llama-lookup-stats`` exactly (docs/native_tools.md).
    """
    if not static_counts:
        return max(reversed(continuations), key=continuations.__getitem__)

    def weighted_count(token: int) -> int:
        static_count = static_counts.get(token)
        weight = STATIC_WEIGHT_SCALE * static_count if static_count else 1
        return continuations[token] * weight

    return max(reversed(continuations), key=weighted_count)


#: Evidence of a drafted token (``Draft.evidence``): (cache, n-gram of at least
#: :data:`LONG_NGRAM` tokens, the n-gram was always followed by this token, it was followed by this
#: token at least twice). Cache: "context", "dynamic" or "static". On 71 replayed prompts these
#: classes accept at very different rates (a unanimous 4-gram of the request itself far more often
#: than a 1-gram's majority), which is what lets the policy verify a long draft whole where it rests
#: on strong matches and cut a weak one. The last bit splits the commonest class, a
#: unanimous long n-gram of the request, into "seen once" and "seen again": replayed with the pass
#: costs of the exact build, +1.3 % geometric mean on the 22 prompts of the oracle run and +1.6 % on
#: 51 other prompts (docs/benchmarks.md, "Levers tried and dropped").
Evidence = Tuple[str, bool, bool, bool]
LONG_NGRAM = 3


def _qualified_continuation(continuations: Dict[int, int], ngram_size: int,
                            thresholds: DraftThresholds,
                            static_counts: Dict[int, int]) -> Optional[int]:
    """The most likely continuation if it passes ``thresholds``, else None."""
    token = _most_likely_continuation(continuations, static_counts)
    sample_size = sum(continuations.values())
    return token if thresholds.accepts(ngram_size, continuations[token], sample_size) else None


def _draft_from_cache(cache: NgramCache, name: str, sequence: Sequence[int], ngram_sizes: Sequence[int],
                      thresholds: DraftThresholds,
                      static_counts: Dict[int, int]) -> Optional[Tuple[int, Evidence]]:
    """The first qualified continuation of ``sequence``'s trailing n-grams, longest first, with
    its evidence."""
    for size in ngram_sizes:
        continuations = cache.get(tuple(sequence[-size:]))
        if continuations:
            token = _qualified_continuation(continuations, size, thresholds, static_counts)
            if token is not None:
                return token, (name, size >= LONG_NGRAM, len(continuations) == 1,
                               continuations[token] >= 2)
    return None


def draft_tokens(context: Sequence[int], max_tokens: int, ngram_min: int, ngram_max: int,
                 context_cache: NgramCache, dynamic_cache: NgramCache,
                 static_cache: NgramCache) -> List[int]:
    """Up to ``max_tokens`` tokens likely to follow ``context``, from three n-gram caches.

    llama.cpp's ``common_ngram_cache_draft``. The draft grows one token at a time; for each, with
    ``sequence = context + draft so far``:

    1. ``static_counts`` = the static cache's continuations of the last 2 tokens (may be empty);
    2. the **context** cache, trying the trailing n-grams of ``sequence`` from ``ngram_max`` down
       to ``ngram_min`` tokens: the first n-gram whose most likely continuation (largest
       ``count * (100 * static count, or 1 if the static cache lacks it)``; on a tie the one
       seen last) passes the :data:`LAX_THRESHOLDS` for its size gives the token;
    3. else the **dynamic** cache, the same way with :data:`STRICT_THRESHOLDS`;
    4. else the **static** cache alone: its most frequent continuation of the last 2 tokens, if it
       passes the lax thresholds of size 2 (sample size >= 2, share >= 50 %);
    5. else stop. Also stop at ``max_tokens``.

    Differences from llama.cpp, both invisible with its settings (``ngram_min = 1``): thresholds
    are indexed by n-gram size (llama.cpp: by position from ``ngram_min``), and n-grams longer than
    ``sequence`` are skipped (llama.cpp reads out of bounds).

    Worked example: a repeated pattern. ``context = [5, 6, 7, 5, 6, 7, 5, 6]`` with n-grams of 1..4
    tokens in the context cache. Step 1: the 4-gram ``(6, 7, 5, 6)`` was followed once, by 7;
    size 4 needs a sample of 1 and 50 %: draft 7. Step 2: ``(7, 5, 6, 7)`` -> 5 (once). Step 3:
    ``(5, 6, 7, 5)`` -> 6 (twice). Step 4: ``(6, 7, 5, 6)`` -> 7 again.

    >>> context = [5, 6, 7, 5, 6, 7, 5, 6]
    >>> context_cache = NgramCache(); context_cache.update(context, 1, 4)
    >>> draft_tokens(context, 4, 1, 4, context_cache, NgramCache(), NgramCache())
    [7, 5, 6, 7]

    A token seen only once after a 1- or 2-gram is not enough (lax sample size 2 at sizes 1, 2):

    >>> context = [1, 2, 3, 1]
    >>> context_cache = NgramCache(); context_cache.update(context, 1, 4)
    >>> draft_tokens(context, 4, 1, 4, context_cache, NgramCache(), NgramCache())
    []

    The static cache breaks the 1:1 tie between the continuations 5 and 6 of ``(1, 2, 3, 4)``
    (without it, the one seen last wins, as in llama.cpp):

    >>> context = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4]
    >>> context_cache = NgramCache(); context_cache.update(context, 1, 4)
    >>> draft_tokens(context, 1, 1, 4, context_cache, NgramCache(), NgramCache())
    [6]
    >>> static_cache = NgramCache(); static_cache.update([3, 4, 5], 2, 2)   # "3 4" -> 5
    >>> draft_tokens(context, 1, 1, 4, context_cache, NgramCache(), static_cache)
    [5]
    """
    return draft_with_evidence(context, max_tokens, ngram_min, ngram_max, context_cache,
                               dynamic_cache, static_cache)[0]


def draft_with_evidence(context: Sequence[int], max_tokens: int, ngram_min: int, ngram_max: int,
                        context_cache: NgramCache, dynamic_cache: NgramCache,
                        static_cache: NgramCache) -> Tuple[List[int], List[Evidence]]:
    """:func:`draft_tokens` and the :data:`Evidence` of each token.

    >>> context = [5, 6, 7, 5, 6, 7, 5, 6]
    >>> context_cache = NgramCache(); context_cache.update(context, 1, 4)
    >>> draft_with_evidence(context, 2, 1, 4, context_cache, NgramCache(), NgramCache())
    ([7, 5], [('context', True, True, False), ('context', True, True, False)])
    """
    if max_tokens < 1 or len(context) < NGRAM_STATIC:
        return [], []
    # Only the last ngram_max tokens are ever looked up; copy them, the draft extends the copy.
    sequence = [int(t) for t in context[-max(ngram_max, NGRAM_STATIC):]]
    draft: List[int] = []
    evidence: List[Evidence] = []
    while len(draft) < max_tokens:
        static_counts = static_cache.get(tuple(sequence[-NGRAM_STATIC:])) or {}
        ngram_sizes = range(min(ngram_max, len(sequence)), ngram_min - 1, -1)
        found = _draft_from_cache(context_cache, "context", sequence, ngram_sizes, LAX_THRESHOLDS,
                                  static_counts)
        if found is None:
            found = _draft_from_cache(dynamic_cache, "dynamic", sequence, ngram_sizes,
                                      STRICT_THRESHOLDS, static_counts)
        if found is None and static_counts:
            token = _qualified_continuation(static_counts, NGRAM_STATIC, LAX_THRESHOLDS, {})
            if token is not None:
                found = token, ("static", False, len(static_counts) == 1, static_counts[token] >= 2)
        if found is None:
            break
        draft.append(found[0])
        evidence.append(found[1])
        sequence.append(found[0])
    return draft, evidence


#: The most n-grams read from a static cache file (its Python table costs ~0.5 KiB per n-gram).
MAX_STATIC_NGRAMS = 2_000_000
#: A learned cache file may hold this many times ``dynamic_max_ngrams`` (a bound lowered since it
#: was saved); it is pruned to the bound after loading.
DYNAMIC_LOAD_MARGIN = 2


class LookupDrafter(Drafter):
    """The ``lookup`` drafter: n-gram drafts from the context, dynamic and static caches.

    Implements :class:`~gemma_spec_ros.engine.drafters.base.Drafter`. Per request: :meth:`begin` with the
    prompt, then :meth:`propose` per step, :meth:`end` with the final tokens.
    :meth:`close` saves the dynamic cache. Not thread-safe: one request at a time.

    ``propose`` is incremental: the context handed to it may only grow by appending (prompt +
    accepted tokens); each call adds only the new tokens to the context cache. A context that is
    not an extension of the previous one (checked on its last 4 known tokens) rebuilds the
    context cache from scratch.

    ``static_cache`` / ``dynamic_cache`` inject ready caches (tests, or one static cache shared by
    several drafters) instead of loading them from ``config``'s paths; a given ``dynamic_cache``
    is still saved to ``config.dynamic_path`` if that is set.

    ``n_vocab``: the target's vocabulary size (default: the one ``vocab_tag`` names, else unknown).
    A cache file holding a token id at or past it was made for another model: a static one is
    refused, a learned one is moved aside as damaged. No draft holds a token id outside
    ``[0, n_vocab)`` whatever the caches hold (given ones too): the first one ends it (llama.cpp
    refuses a batch with such an id whole, so the step, and the request, would fail).

    Raises :class:`~gemma_spec_ros.engine.errors.CacheFormatError` if the static cache file is
    missing or corrupt (or of another vocabulary), or the dynamic cache file exists but is not
    this engine's or of another vocabulary.
    """

    name = "lookup"
    cheap_to_probe = True  # a probe is a few dictionary lookups
    cuts_drafts = True  # its drafts carry their evidence: the policy cuts each one (policy.py)
    #: not under a grammar: its constrained drafts keep the per-step length (replayed, cutting them
    #: too gained 1-8 % on the planner trace with the plan schema; not timed yet)
    cuts_constrained_drafts = False

    def __init__(self, config: LookupConfig, static_cache: Optional[NgramCache] = None,
                 dynamic_cache: Optional[NgramCache] = None, vocab_tag: str = "",
                 n_vocab: Optional[int] = None) -> None:
        if static_cache is not None and config.static_path:
            raise ValueError("pass either a static cache or LookupConfig.static_path, not both")
        self.config = config
        self._vocab_tag = vocab_tag  # the learned cache file belongs to this vocabulary
        #: token ids a draft may hold are below it (None: unknown, no bound)
        self.n_vocab = n_vocab if n_vocab is not None else learned_cache.tag_vocab_size(vocab_tag)
        self._static_path = expand_path(config.static_path)
        self._dynamic_path = expand_path(config.dynamic_path)
        if static_cache is not None:
            self._static_cache = static_cache
        else:  # a configured static cache must exist: it was built on purpose
            self._static_cache = (learned_cache.load_static(self._static_path, vocab_tag, MAX_STATIC_NGRAMS,
                                                            self.n_vocab)
                                  if self._static_path else NgramCache())
        self.warnings: List[str] = []  # for the owner to log (e.g. a corrupt cache moved aside)
        if self._dynamic_path:  # its folder: created inside lookup.cache_dir, else it must exist
            learned_cache.prepare_folder(self._dynamic_path, expand_path(config.cache_dir))
        self._dynamic_cache = (dynamic_cache if dynamic_cache is not None
                               else self._load_dynamic(self._dynamic_path))
        #: the learned cache's file: changed since saved, the periodic save, a failed save
        self.saved = SavedState(self._dynamic_path, config.save_period, self._write, "the learned n-gram cache")
        self._owns_saved = True  # for_slot's drafters share their owner's, which saves it
        self._context_cache = NgramCache()
        self._context_length = 0  # tokens of the current request already in the context cache
        # its last NGRAM_MAX tokens, to detect a context that is not a continuation
        self._context_tail: Tuple[int, ...] = ()

    def _load_dynamic(self, path: str) -> NgramCache:
        """The learned cache at ``path`` (empty if there is none yet). Only a file this engine wrote
        is read, and only one of this vocabulary: anything else is refused (CacheFormatError) and
        left untouched. One of ours whose records are broken (a disk error) is moved aside to a new
        ``<path>.corrupt-<time>-<random>`` with a warning, and learning starts again: losing learned
        n-grams must not stop a robot."""
        if not path:
            return NgramCache()
        bound = self.config.dynamic_max_ngrams
        try:
            cache = learned_cache.load(path, self._vocab_tag, DYNAMIC_LOAD_MARGIN * bound, self.n_vocab)
        except learned_cache.CorruptLearnedCacheError as error:
            aside = learned_cache.move_aside(path)
            self.warnings.append(f"{error}; moved it to {aside} and started an empty one")
            return NgramCache()
        cache.prune(bound)
        return cache

    # ---------------------------------------------------------------------------------- caches
    @property
    def context_cache(self) -> NgramCache:
        """N-grams of the current request (read-only by convention)."""
        return self._context_cache

    @property
    def dynamic_cache(self) -> NgramCache:
        """N-grams learned from finished requests (read-only by convention)."""
        return self._dynamic_cache

    @property
    def static_cache(self) -> NgramCache:
        """Corpus 2-grams (read-only)."""
        return self._static_cache

    def _reset_context(self) -> None:
        self._context_cache = NgramCache()
        self._context_length = 0
        self._context_tail = ()

    def _extend_context(self, tokens: Sequence[int]) -> None:
        """Bring the context cache up to ``tokens``, adding only what is new since the last call."""
        known = self._context_length
        known_tail = tuple(tokens[max(0, known - NGRAM_MAX):known])
        if len(tokens) < known or known_tail != self._context_tail:
            self._reset_context()
            known = 0
        if len(tokens) == known:
            return
        self._context_cache.update(tokens, self.config.ngram_min, self.config.ngram_max,
                                   start_index=known)
        self._context_length = len(tokens)
        self._context_tail = tuple(int(t) for t in tokens[-NGRAM_MAX:])

    # ------------------------------------------------------------------------------------ Drafter
    def begin(self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None,
              rng: Optional["np.random.Generator"] = None) -> None:
        """Start a request: the context cache restarts from the prompt's n-grams. N-gram drafts
        are deterministic whatever the sampling: ``sampling`` and ``rng`` are not used."""
        self._reset_context()
        self._extend_context(prompt_tokens)

    def propose(self, context: Sequence[int], max_tokens: int, spec: SpecConfig = SpecConfig()) -> Draft:
        """Up to ``max_tokens`` tokens to follow ``context`` (prompt + accepted tokens so far);
        the empty draft if no n-gram qualifies. See :func:`draft_tokens`; ``spec``'s limits are the
        draft model's, not used here."""
        self._extend_context(context)
        tokens, evidence = draft_with_evidence(context, max_tokens, self.config.ngram_min,
                                               self.config.ngram_max, self._context_cache,
                                               self._dynamic_cache, self._static_cache)
        keep = learned_cache.in_vocabulary(tokens, self.n_vocab)  # never an id the target lacks
        tokens, evidence = tokens[:keep], evidence[:keep]
        if not tokens:
            return EMPTY_DRAFT
        return Draft(tokens=tuple(tokens), probs=None, source=self.name, evidence=tuple(evidence))

    def end(self, tokens: Sequence[int]) -> None:
        """The request finished with ``tokens`` (prompt + generated): merge its n-grams into the
        dynamic cache, as llama.cpp's lookup example does at exit. Call once per request."""
        self._extend_context(tokens)
        self._dynamic_cache.merge(self._context_cache)
        if len(self._context_cache) > 0:
            self.saved.learned()
        self._reset_context()
        self._dynamic_cache.prune(self.config.dynamic_max_ngrams)
        self.saved.save_if_due()

    def save(self) -> None:
        """Save the dynamic cache now (atomically) if ``LookupConfig.dynamic_path`` is set; only over
        a file this engine wrote (ForeignFileError otherwise)."""
        self.saved.save()

    def _write(self) -> None:
        learned_cache.save(self._dynamic_cache, self._dynamic_path, self._vocab_tag)

    def take_fault(self) -> Optional[str]:
        """A periodic save's failure since the last call (reported once), else None."""
        return self.saved.take_fault()

    def status(self) -> Dict[str, Any]:
        return {"dynamic cache n-grams": len(self._dynamic_cache)}

    def for_slot(self, seq: int) -> "LookupDrafter":
        """A drafter of this one's static and dynamic caches with a context cache of its own: what
        its requests teach lands in the shared dynamic cache, which this drafter prunes and saves."""
        other = LookupDrafter(LookupConfig(ngram_min=self.config.ngram_min, ngram_max=self.config.ngram_max,
                                           dynamic_max_ngrams=self.config.dynamic_max_ngrams, save_period=0.0),
                              static_cache=self._static_cache, dynamic_cache=self._dynamic_cache,
                              n_vocab=self.n_vocab)
        other.saved, other._owns_saved = self.saved, False
        return other

    def close(self) -> None:
        """Save the dynamic cache to ``LookupConfig.dynamic_path`` if that is set, unless the file
        exists and the cache learned nothing since it was loaded or last saved (a large cache is
        not rewritten for nothing); a for_slot drafter leaves that to its owner. Safe to call more
        than once."""
        if self._owns_saved:
            self.saved.close()


def build(config: EngineConfig, target: "LlamaModel", n_seq: int) -> "LookupDrafter":
    """The kind's builder (``engine/drafter_kinds.py``): the caches of ``lookup``."""
    lookup = config.lookup
    tag = target.vocab_tag() if lookup.dynamic_path or lookup.static_path else ""
    return LookupDrafter(lookup, vocab_tag=tag, n_vocab=target.n_vocab)
