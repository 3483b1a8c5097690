"""ROS-free speculative decoding engine (numpy + llama_cpp + stdlib only).

Import the public names from here; see :mod:`gemma_spec_ros.engine.engine` for the API.
llama_cpp is imported only when a model is loaded, so configs and requests can be validated
without it.
"""
from .stats import SpecStats
from .types import (DRAFT_MODES, SPEC_MODES, VERIFICATIONS, CacheFormatError, Draft, Drafter, EngineConfig,
                    EngineError, GenerationRequest, KVCacheError, LookupConfig, ModelConfig, ModelLoadError,
                    PromptTooLongError, SamplingParams, SpecConfig, Step, VocabMismatchError)

__all__ = [
    "DRAFT_MODES", "SPEC_MODES", "VERIFICATIONS", "CacheFormatError", "Draft", "Drafter", "EngineConfig",
    "EngineError", "GenerationRequest", "KVCacheError", "LookupConfig", "ModelConfig", "ModelLoadError",
    "PromptTooLongError", "SamplingParams", "SpecConfig", "SpecStats", "Step", "VocabMismatchError",
]
