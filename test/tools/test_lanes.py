"""The test lanes of test/conftest.py name what exists: every test of ``LANE_TESTS`` and every
fixture of ``LANE_FIXTURES``. A renamed test or fixture would otherwise leave its entry behind
silently, and the test it stood for would run in `make test-fast` (``-m "not model and not process
and not ros"``) with a model, a process or a ROS graph it does not say it needs."""
from __future__ import annotations

import re
from pathlib import Path

import conftest


def test_every_listed_test_exists(repo_root: Path) -> None:
    missing = []
    for key in conftest.LANE_TESTS:
        path, _, name = key.partition("::")
        file = repo_root / path
        if not file.is_file() or (name and not re.search(rf"^\s*def {re.escape(name)}\(", file.read_text(), re.M)):
            missing.append(key)
    assert not missing, f"LANE_TESTS names tests that do not exist: {missing}"


def test_every_lane_fixture_exists(repo_root: Path) -> None:
    sources = "\n".join(path.read_text() for path in (repo_root / "test").rglob("*.py"))
    defined = set(re.findall(r"@pytest\.fixture[^\n]*\n(?:\s*@[^\n]*\n)*\s*def (\w+)\(", sources))
    missing = sorted(name for names in conftest.LANE_FIXTURES.values() for name in names if name not in defined)
    assert not missing, f"LANE_FIXTURES names fixtures that do not exist: {missing}"


def test_the_lanes_are_the_registered_markers(pytestconfig) -> None:
    registered = {line.split(":", 1)[0].strip() for line in pytestconfig.getini("markers")}
    used = set(conftest.LANE_FIXTURES) | {lane for lanes, _ in conftest.LANE_TESTS.values() for lane in lanes}
    assert used <= registered, used - registered
