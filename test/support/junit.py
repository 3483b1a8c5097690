"""The counts of a child pytest's JUnit XML report (the tests that run pytest in another
interpreter or build: test_exact_build, test_humble_floor)."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict


def junit_counts(report: Path) -> Dict[str, int]:
    """``tests``, ``failures``, ``errors`` and ``skipped`` of the report's (first) test suite."""
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}
