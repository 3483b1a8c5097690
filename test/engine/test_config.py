"""Validation of the engine's configuration and requests (engine/config.py, engine/request.py)."""
import pytest

from gemma_spec_ros.engine.config import EngineConfig, LookupConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest


@pytest.mark.parametrize("make, message", [
    (lambda: SpecConfig(mode="turbo"), "expected one of"),
    (lambda: SpecConfig(draft_max=0), "draft_max"),
    (lambda: SpecConfig(verification="maybe"), "verification"),
    (lambda: SamplingParams(temperature=float("nan")), "temperature"),
    (lambda: SamplingParams(temperature=-1.0), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_k=-1), "top_k"),
    (lambda: GenerationRequest(""), "prompt is empty"),
    (lambda: GenerationRequest("x", max_tokens=0), "max_tokens"),
    (lambda: LookupConfig(ngram_min=3, ngram_max=2), "n-gram"),
    (lambda: ModelConfig(""), "model path is empty"),
    (lambda: EngineConfig(ModelConfig("t.gguf"), spec=SpecConfig(mode="draft")), "needs a draft model"),
])
def test_bad_config_is_refused_with_an_actionable_message(make, message):
    with pytest.raises(ValueError, match=message):
        make()
