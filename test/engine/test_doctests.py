"""The worked examples in the engine's docstrings run: every module of the engine and its parts
(merge rules, text, sampling, verification, the mode table, the policy's maths, the remote
backend's wire formats, ...). None of them needs a model."""
from __future__ import annotations

import doctest
import importlib
import pkgutil
from types import ModuleType
from typing import List

import pytest

import gemma_spec_ros.engine as engine_package


def engine_modules() -> List[ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(engine_package.__path__, engine_package.__name__ + ".")]
    return [importlib.import_module(name) for name in sorted(names)]


MODULES = [module for module in engine_modules() if doctest.DocTestFinder().find(module)
           and any(test.examples for test in doctest.DocTestFinder().find(module))]


def test_the_examples_are_found() -> None:
    """The modules with worked examples are collected (a wrong walk would test nothing)."""
    names = {module.__name__.rsplit(".", 1)[-1] for module in MODULES}
    assert {"lookup", "sampling", "stats", "modes", "sse"} <= names


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0
