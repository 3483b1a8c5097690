"""ament_copyright: the sources carry no per-file copyright header; the package's license,
Apache-2.0 as package.xml says, is stated once in the LICENSE file beside package.xml (the
repository's dev suite checks that file: test/tools/test_package.py)."""
import pytest


@pytest.mark.copyright
@pytest.mark.linter
@pytest.mark.skip(reason="no per-file copyright headers: the license is the LICENSE file beside package.xml")
def test_copyright() -> None:
    from ament_copyright.main import main
    assert main(argv=[".", "test"]) == 0
