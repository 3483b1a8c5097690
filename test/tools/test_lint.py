"""The linter stance, enforced here: flake8 and pydocstyle from PyPI over each ament_python package
with the [flake8] / [pydocstyle] sections of its setup.cfg, the same checks that ament_flake8 and
ament_pep257 run under `colcon test` (gemma_spec_ros/test/test_flake8.py, test_pep257.py).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gemma_spec_ros", "gemma_spec_dev")


def python_paths(package_dir: Path) -> List[str]:
    """What a package's linters read: its module, its launch files and its tests."""
    return [str(package_dir / name) for name in (package_dir.name, "launch", "test", "setup.py")
            if (package_dir / name).exists()]


def flake8(package_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flake8", "--config", str(package_dir / "setup.cfg"),
                           *python_paths(package_dir)], cwd=package_dir, capture_output=True, text=True, timeout=300)


def pydocstyle(package_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pydocstyle", f"--config={package_dir / 'setup.cfg'}",
                           *python_paths(package_dir)], cwd=package_dir, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", autouse=True)
def linters() -> None:
    for module in ("flake8", "pydocstyle"):
        if shutil.which(module, path=str(Path(sys.executable).parent)) is None:
            pytest.fail(f"{module} is not installed in this venv: run `make setup`")


@pytest.mark.parametrize("package", PACKAGES)
def test_flake8_finds_nothing(package: str) -> None:
    done = flake8(REPO / package)
    assert done.returncode == 0, f"flake8 ({package}/setup.cfg):\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("package", PACKAGES)
def test_pydocstyle_finds_nothing(package: str) -> None:
    done = pydocstyle(REPO / package)
    assert done.returncode == 0, f"pydocstyle ({package}/setup.cfg):\n{done.stdout}{done.stderr}"


def test_the_checks_fail_on_a_file_against_the_house_style(tmp_path: Path) -> None:
    """A package with gemma_spec_ros's setup.cfg and one module of a too-long line, a missing blank
    line, an unused import and a docstring in single quotes: each check names its finding."""
    package = tmp_path / "gemma_spec_ros"
    (package / "gemma_spec_ros").mkdir(parents=True)
    shutil.copy(REPO / "gemma_spec_ros" / "setup.cfg", package / "setup.cfg")
    (package / "gemma_spec_ros" / "bad.py").write_text(
        "import os\n"
        "def f() -> str:\n"
        "    '''Return a string.'''\n"
        f"    return '{'x' * 120}'\n")
    out = flake8(package).stdout
    assert {"E501", "E302", "F401"} <= {line.split()[1] for line in out.splitlines()}, out
    done = pydocstyle(package)
    assert done.returncode != 0 and "D300" in done.stdout, done.stdout + done.stderr
