"""The engine: target model + drafters + policy, serving one generation at a time.

Public API (the node and the bench use only this):

    engine = Engine(config)                  # loads models; raises ModelLoadError / VocabMismatchError
    engine.set_mode("lookup")                # thread-safe; takes effect at the next step
    engine.set_draft_max(4)                  # thread-safe; takes effect at the next step
    for step in engine.generate(request, cancel=threading.Event()):
        step.text, step.tokens, step.stats   # new text (whole UTF-8 chars), new tokens, stats so far
        step.finish_reason                   # None until the last step
    engine.rolling_stats()                   # SpecStats over all requests so far (a copy)
    engine.count_prompt_tokens(request)      # tokens of the (templated) prompt, for validation
    engine.model_info()                      # dict: paths, sizes, n_gpu_layers, vocab, n_ctx
    engine.close()                           # frees models, saves the dynamic n-gram cache
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
    finish_reason: Optional[str] = None  # stop | length | cancelled | error on the last step
    error: str = ""  # message when finish_reason == "error"
