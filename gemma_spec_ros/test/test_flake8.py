"""ament_flake8 over this package, configured by the [flake8] section of its setup.cfg (the house
style: 120 columns). Where ament_flake8 is not installed the test skips; the repository's dev suite
runs the same check with flake8 from PyPI (test/tools/test_lint.py)."""
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]


@pytest.mark.flake8
@pytest.mark.linter
def test_flake8() -> None:
    ament_flake8 = pytest.importorskip("ament_flake8.main", reason="ament_flake8 is not installed")
    rc, errors = ament_flake8.main_with_errors(
        argv=["--config", str(PACKAGE_DIR / "setup.cfg"), str(PACKAGE_DIR)])
    assert rc == 0, f"{len(errors)} flake8 finding(s):\n" + "\n".join(errors)
