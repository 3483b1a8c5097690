"""The worked examples in the engine's pure modules' docstrings run (merge rules, text, sampling,
verification)."""
from __future__ import annotations

import doctest
from types import ModuleType

import pytest

from gemma_spec_ros.engine import policy, sampling, stats, text, verify


@pytest.mark.parametrize("module", [policy, sampling, stats, text, verify], ids=lambda m: m.__name__)
def test_module_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0
