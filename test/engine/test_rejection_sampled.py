"""``spec.verification: rejection`` at a temperature above 0, on the numpy a robot has.

Rejection verification samples each draft from a stream of its own, derived from the request's
seed. Ubuntu 22.04 (ROS 2 Humble, JetPack 6) ships numpy 1.21, whose ``Generator`` has no
``spawn`` (numpy >= 1.25): these tests run under whatever numpy the venv holds, so a lane with the
robot's versions runs them there. Tiny random-weight F32 pair (same vocabulary), loads in ms.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import numpy as np
import pytest

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.sampling import draft_stream
from gemma_spec_ros.engine.config import SamplingParams, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine, collect
from support.tiny_gguf import write_tiny_pair


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("tiny"))
    engine = build_engine(
        target, draft, n_threads=1, calibrate=True,
        spec=SpecConfig(mode="draft", draft_max=3, adaptive=False, p_min=0.0, verification="rejection"))
    yield engine
    engine.close()


def sampled(engine: Engine, seed: int) -> Tuple[list, str, int]:
    """(tokens, finish reason, drafted tokens) of one sampled request."""
    request = GenerationRequest("ab", max_tokens=40,
                                sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=seed))
    done = collect(engine, request)
    return done.tokens, done.steps[-1].finish_reason, done.stats.num_draft_tokens


@pytest.mark.timeout(120)
def test_a_sampled_request_under_rejection_verification_succeeds_and_repeats_per_seed(engine: Engine) -> None:
    """numpy 1.21 ended every such request with AttributeError ('Generator' has no 'spawn')."""
    first = sampled(engine, seed=11)
    assert first[1] in ("stop", "length") and first[2] > 0, first
    assert sampled(engine, seed=11) == first  # the drafts' stream too depends on the seed alone
    others = {tuple(sampled(engine, seed)[0]) for seed in (12, 13, 14)}
    assert len(others | {tuple(first[0])}) > 1, "the seed does not reach the sampler"


def test_the_draft_stream_is_the_one_numpy_spawn_gives() -> None:
    """Where numpy has ``Generator.spawn`` (>= 1.25), the stream equals its first child: a seeded
    request draws the same drafts on a robot's numpy 1.21 as on a newer one."""
    if not hasattr(np.random.Generator, "spawn"):
        pytest.skip(f"numpy {np.__version__} has no Generator.spawn to compare with (it came in 1.25)")
    ours = draft_stream(np.random.default_rng(5)).random(4)
    assert (ours == np.random.default_rng(5).spawn(1)[0].random(4)).all()
