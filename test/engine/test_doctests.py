"""The worked examples in the engine's pure modules' docstrings run (merge rules, text, sampling,
verification, the plain prompt, and the remote backend's wire rooms)."""
from __future__ import annotations

import doctest
from types import ModuleType

import pytest

from gemma_spec_ros.engine import policy, sampling, stats, text, types, verify
from gemma_spec_ros.engine.remote import http, metrics, payload, sse

MODULES = [policy, sampling, stats, text, types, verify, http, metrics, payload, sse]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0
