"""ament_pep257 over this package, with the rules of the [pydocstyle] section of its setup.cfg.
Where ament_pep257 is not installed the test skips; the repository's dev suite runs the same check
with pydocstyle from PyPI (test/tools/test_lint.py)."""
import configparser
from pathlib import Path
from typing import List

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def pydocstyle_arguments() -> List[str]:
    """The convention and the rules setup.cfg leaves out, as ament_pep257's arguments."""
    config = configparser.ConfigParser()
    config.read(PACKAGE_DIR / "setup.cfg")
    section = config["pydocstyle"]
    ignored = [code.strip() for code in section["add-ignore"].split(",") if code.strip()]
    return ["--convention", section["convention"], "--add-ignore", *ignored]


@pytest.mark.linter
@pytest.mark.pep257
def test_pep257() -> None:
    ament_pep257 = pytest.importorskip("ament_pep257.main", reason="ament_pep257 is not installed")
    rc = ament_pep257.main(argv=[str(PACKAGE_DIR), *pydocstyle_arguments()])
    assert rc == 0, "pep257 findings (printed above)"
