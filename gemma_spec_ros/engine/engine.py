"""The engine: target model + drafters + policy, serving one generation at a time.

Public API (the node and the bench use only this):

    engine = Engine(config)                  # loads models; raises ModelLoadError, VocabMismatchError,
                                             # CacheFormatError (all EngineError) or ValueError
    engine.spec                              # current SpecConfig (frozen)
    engine.check_spec(spec) -> str           # '' if usable, else the reason (e.g. no draft model)
    engine.update_spec(spec)                 # thread-safe; raises ValueError(reason); next step uses it
    engine.set_mode("lookup"); engine.set_draft_max(4)   # shortcuts for update_spec(replace(...))
    engine.count_prompt_tokens(request)      # tokens of the (templated) prompt; thread-safe, ~ms
    engine.check_request(request)            # raises PromptTooLongError if prompt + max_tokens > n_ctx
    engine.n_ctx                             # target context length (tokens)
    for step in engine.generate(request, cancel=threading.Event()):
        step.text, step.tokens, step.stats   # new text (whole UTF-8 chars), new tokens, stats so far
        step.spec_mode, step.draft_max       # what was in effect at this step
        step.finish_reason                   # None until the last step: stop | length | cancelled
    # generate() raises EngineError (e.g. PromptTooLongError, KVCacheError) on failure; the engine
    # stays usable for the next request. One generate() at a time (the node serialises).
    engine.rolling_stats()                   # SpecStats over all requests so far (a copy)
    engine.model_info()                      # dict: target/draft path, size_bytes, n_gpu_layers,
                                             # n_ctx, n_vocab, vocab_type, description
    engine.close()                           # frees models, saves the dynamic n-gram cache; idempotent
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .stats import SpecStats


@dataclass(frozen=True)
class Step:
    """What one engine step produced. The last step of a generation has ``finish_reason`` set."""

    tokens: Tuple[int, ...]  # tokens emitted at this step (may be empty, e.g. held by a stop string)
    text: str  # new text since the previous step: whole UTF-8 characters, stop strings excluded
    stats: SpecStats  # the request's stats so far (a snapshot; safe to keep)
    spec_mode: str  # mode in effect at this step ("auto:lookup" style when auto chose)
    draft_max: int  # K in effect at this step
    finish_reason: Optional[str] = None  # stop | length | cancelled on the last step
