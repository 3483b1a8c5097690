"""Humble's Python floor: the engine and node tests under Python 3.10 with the package versions a
robot gets from Ubuntu 22.04's apt (constraints/humble-jammy.txt: numpy 1.21.5, PyYAML 5.4.1,
jsonschema 3.2.0, ...) and the Jazzy wheels for cp310.

`make test` makes that venv, ``.venv-humble`` (scripts/setup_humble_lane.sh, where a Python 3.10 is
found); this test runs the lane's test files there in a child pytest and fails unless every one of
them ran and passed. Those of bit-identical output (``exact``) stay in the main venv: they test
llama.cpp's arithmetic, not the Python floor.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.junit import junit_counts

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints" / "humble-jammy.txt"
#: What runs on the floor: the engine's pure and model layers (numpy sampling, rejection
#: verification at a temperature, the n-gram caches' files, YAML/JSON configs and schemas) and the
#: node over real rclpy (parameters, goals, diagnostics, the client).
LANE_FILES = (
    "test/engine/test_sampling.py", "test/engine/test_verify.py", "test/engine/test_policy.py",
    "test/engine/test_stats.py", "test/engine/test_config.py",
    "test/engine/test_doctests.py", "test/engine/test_rejection_sampled.py",
    "test/engine/test_ngram_cache.py", "test/engine/test_cache_files.py",
    "test/engine/test_sampling_with_speculation.py", "test/engine/test_modes.py", "test/engine/test_grammar.py",
    "test/node/test_parameters.py", "test/node/test_goal_fields.py", "test/node/test_inprocess.py",
    "test/node/test_interfaces.py",
)
#: Left to the main venv: the same on any Python and long (every mode under a grammar, ~2.5 min).
LANE_DESELECTED = ("test/engine/test_grammar.py::test_every_mode_gives_a_plan_that_parses_and_validates",)


def humble_venv() -> Path:
    return Path(os.environ.get("GEMMA_SPEC_HUMBLE_VENV") or REPO / ".venv-humble")


def pinned_versions() -> dict:
    """``name -> version`` of the constraints file's ``==`` pins."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if "==" in spec:
            name, version = spec.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


@pytest.mark.timeout(3600)
def test_the_engine_and_node_tests_pass_on_humbles_python_floor(tmp_path: Path) -> None:
    python = humble_venv() / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {humble_venv()}: scripts/setup_humble_lane.sh makes it where a Python 3.10 is found "
                    "(`make test` runs it)")
    # the child's ROS wheels set their own library path (this process's would name .venv's libraries)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_ROS_WHEELS", "PYTHON", "LD_LIBRARY_PATH"))}
    env["AMENT_PREFIX_PATH"] = str(humble_venv())
    probe = subprocess.run(
        [str(python), "-c", "import json, sys, importlib.metadata as m; print(sys.version_info[:2]); "
         "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))", *pinned_versions()],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    version_line, installed_line = probe.stdout.strip().splitlines()[-2:]
    assert version_line == "(3, 10)", probe.stdout
    installed = {name.lower(): version for name, version in json.loads(installed_line).items()}
    assert installed == pinned_versions(), f"{humble_venv()} does not hold the constraints: {installed}"
    report = tmp_path / "humble.xml"
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-m", "not exact", "-q", "-rs", "-p", "no:cacheprovider",
         f"--junitxml={report}", *(f"--deselect={test}" for test in LANE_DESELECTED), *LANE_FILES],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=3500)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    counts = junit_counts(report)
    assert counts["failures"] == counts["errors"] == 0, (counts, tail)
    assert counts["tests"] - counts["skipped"] >= 100, (counts, tail)
    print(f"\nHumble floor ({sys.platform}, Python 3.10): {counts}")
