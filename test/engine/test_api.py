"""Every engine the node may hold implements the whole GenerationEngine contract (engine/api.py)
with the contract's parameter names, so the node needs no getattr on its engine."""
from __future__ import annotations

import inspect

import pytest

from gemma_spec_ros.engine.api import GenerationEngine
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.fallback import FallbackEngine
from gemma_spec_ros.engine.remote import RemoteEngine

MEMBERS = sorted(name for name in vars(GenerationEngine)
                 if not name.startswith("_") and name not in ("mro",))


def test_the_contract_names_what_the_node_uses() -> None:
    assert {"spec", "n_ctx", "warnings", "check_spec", "update_spec", "count_prompt_tokens",
            "check_request", "generate", "take_faults", "rolling_stats", "model_info", "status",
            "close"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [Engine, RemoteEngine, FallbackEngine], ids=lambda c: c.__name__)
def test_each_engine_implements_every_member_alike(cls: type) -> None:
    for name in MEMBERS:
        wanted = inspect.getattr_static(GenerationEngine, name)
        have = inspect.getattr_static(cls, name, None)
        assert have is not None, f"{cls.__name__} lacks {name}"
        if isinstance(wanted, property):
            assert isinstance(have, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert list(inspect.signature(have).parameters) == list(inspect.signature(wanted).parameters), \
            f"{cls.__name__}.{name}{inspect.signature(have)} differs from the contract's {inspect.signature(wanted)}"
