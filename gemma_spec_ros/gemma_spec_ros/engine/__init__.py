"""ROS-free speculative decoding engine (numpy + llama_cpp + stdlib only).

Its parts: the llama.cpp layer (:mod:`.llama`), the drafters (:mod:`.drafters`), how long to draft
(:mod:`.policy`), constrained output (:mod:`.grammar`), the generation loop (:mod:`.engine` with
:mod:`.propose`, :mod:`.sampling` (choosing tokens: sampling, verification), :mod:`.request_state`,
:mod:`.detokenize`, :mod:`.stats`) and the remote backend (:mod:`.remote`); the one table of modes is :mod:`.modes`.

Import the public names from here. The engines (``Engine``, ``RemoteEngine``, ``FallbackEngine``)
are imported on first use, so configs and requests validate without numpy or llama_cpp, and a
process can load llama.cpp before anything else (:func:`.llama.process.import_llama_cpp_first`).
"""
from typing import Any

from .config import VERIFICATIONS, EngineConfig, LookupConfig, ModelConfig, SamplingParams, SpecConfig
from .drafters.base import Draft, Drafter
from .errors import (CacheFormatError, EngineError, KVCacheError, ModelLoadError, PromptTooLongError,
                     VocabMismatchError)
from .modes import MODES, SPEC_MODES
from .request import CountedPrompt, GenerationRequest, Step
from .stats import SpecStats

#: The engines and their contract, by name -> module (imported on first use: see the docstring).
_LAZY = {"Engine": ".engine", "GenerationEngine": ".api", "RemoteEngine": ".remote",
         "FallbackEngine": ".fallback"}


def __getattr__(name: str) -> Any:  # PEP 562
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MODES", "SPEC_MODES", "VERIFICATIONS", "CacheFormatError", "CountedPrompt", "Draft", "Drafter",
    "Engine", "EngineConfig", "EngineError", "FallbackEngine", "GenerationEngine", "GenerationRequest",
    "KVCacheError", "LookupConfig", "ModelConfig", "ModelLoadError", "PromptTooLongError",
    "RemoteEngine", "SamplingParams", "SpecConfig", "SpecStats", "Step", "VocabMismatchError",
]
