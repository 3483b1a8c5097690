"""The user's documentation holds together: every relative link of README.md and docs/*.md reaches a
file that exists (and, for a link into a Markdown page, a heading that exists), the README stays a
short manual, and no page speaks of the history of the work instead of the product.

A moved or renamed file, page or heading breaks a link silently on a rendered page; this is where it
fails instead.
"""
from __future__ import annotations

import importlib
import re
import unicodedata
from pathlib import Path
from typing import List, Set

import pytest

#: The README is the manual's first page; the rest lives in docs/ (~250 lines).
README_MAX_LINES = 250
#: ``[text](target)`` and ``![alt](target)``; the target ends at the first space or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
#: Work-process words that belong in commit messages, never in a page.
HISTORY = re.compile(r"\b(sessions? [0-9]+|issues? [0-9]+)\b|ENV\.md", re.IGNORECASE)


def pages(repo_root: Path) -> List[Path]:
    return [repo_root / "README.md", *sorted((repo_root / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out, line breaks kept (a link's
    text may wrap onto the next line)."""
    fenced = False
    lines = []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else CODE_SPAN.sub("", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(ch for ch in heading.strip().lower()
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub numbers them."""
    seen: Set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            anchor, n = base, 0
            while anchor in seen:
                n += 1
                anchor = f"{base}-{n}"
            seen.add(anchor)
    return seen


def link_problems(page: Path) -> List[str]:
    problems = []
    text = prose(page.read_text(encoding="utf-8"))
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this test's business
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.name}:{text.count(chr(10), 0, match.start()) + 1}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading with that anchor in {resolved.name}")
    return problems


@pytest.mark.parametrize("heading, anchor", [
    ("2. A robot plus an edge GPU server (llama-server)", "2-a-robot-plus-an-edge-gpu-server-llama-server"),
    ("Against llama.cpp's own `tools`", "against-llamacpps-own-tools"),
    ("rqt_plot: τ and tokens/s over time", "rqt_plot-τ-and-tokenss-over-time"),
])
def test_a_heading_gets_githubs_anchor(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_every_relative_link_reaches_an_existing_file_and_heading(repo_root: Path) -> None:
    problems = [problem for page in pages(repo_root) for problem in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_short_manual(repo_root: Path) -> None:
    lines = (repo_root / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_no_page_speaks_of_the_history_of_the_work(repo_root: Path) -> None:
    found = [f"{page.name}:{number}: {line.strip()}"
             for page in pages(repo_root) + [repo_root / "CHANGELOG.md"]
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if HISTORY.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("broken, why", [
    ("[a](docs/nowhere.md)", "no such file"),
    ("[a](docs/design.md#no-such-heading)", "no heading"),
])
def test_the_link_check_sees_a_broken_link(tmp_path: Path, broken: str, why: str) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## The floor plan\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(f"See {broken} and [b](docs/design.md#the-floor-plan) and `[c](not/a/link.md)`,\n"
                    "[a link that\nwraps](docs/design.md#the-floor-plan).\n", encoding="utf-8")
    assert [problem for problem in link_problems(page) if why in problem] != []
    assert len(link_problems(page)) == 1


def test_every_mode_is_in_every_list_of_modes(repo_root: Path, venv_python: Path) -> None:
    """The mode table (engine/modes.py) is the one source: every mode is a row of the README's
    modes table, in docs/interfaces.md's ``spec_mode`` row, named in the generated
    docs/parameters.md and offered by `gemma-spec-generate --help`; no interface file lists modes
    by hand (they drifted: --help offered five of nine)."""
    import subprocess

    from gemma_spec_ros.engine.modes import SPEC_MODES

    readme = (repo_root / "README.md").read_text()
    table_rows = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9+]+)`( \(default\))? \|", readme, re.M)}
    parameters = (repo_root / "docs" / "parameters.md").read_text()
    spec_mode_row = next(line for line in (repo_root / "docs" / "interfaces.md").read_text().splitlines()
                         if line.startswith("| | `spec_mode` |"))
    help_text = subprocess.run([str(venv_python), "-m", "gemma_spec_ros.tools.generate", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    for mode in SPEC_MODES:
        assert mode in table_rows, f"{mode} is not a row of the README's modes table"
        assert re.search(rf"one of: [^|]*\b{re.escape(mode)}[,;]", parameters), f"docs/parameters.md lacks {mode}"
        assert re.search(rf"(^|[ |]){re.escape(mode)}([ |]|$)", " ".join(help_text.split())), mode
        assert f"`{mode}`" in spec_mode_row, f"docs/interfaces.md's spec_mode row lacks {mode}"
    for path in [*(repo_root / "gemma_spec_msgs").rglob("*.action"), *(repo_root / "gemma_spec_msgs").rglob("*.msg")]:
        assert not re.search(r"off ?\| ?draft ?\| ?lookup", path.read_text()), path


def test_every_parameter_group_is_in_the_interfaces_table(repo_root: Path) -> None:
    """docs/interfaces.md's table of parameter groups names every group of the table."""
    from gemma_spec_ros.node.parameters import PARAMETERS

    interfaces = (repo_root / "docs" / "interfaces.md").read_text()
    table = interfaces[interfaces.index("## Parameters"):]
    for group in sorted({p.name.split(".")[0] for p in PARAMETERS}):
        assert f"`{group}" in table, f"parameter group {group} is missing from docs/interfaces.md"


#: A trip line of docs/design.md: "N. `path.py:Function`" (a method as Class.method).
TRIP_LINE = re.compile(r"^\d+\. `([\w/]+)\.py:([\w.]+)`", re.M)


def test_every_function_of_the_three_trips_exists(repo_root: Path) -> None:
    """design.md's three trips (a plain step, what a constrained step adds, what a chat turn
    adds) name functions that exist, in lists of at most 14, 4 and 5 lines."""
    text = (repo_root / "docs" / "design.md").read_text()
    section = text[text.index("## Three trips through the code"):]
    section = section[:section.index("\n## ", 4)]
    lists = [TRIP_LINE.findall(part) for part in section.split("**")[1:] if TRIP_LINE.search(part)]
    assert [len(found) for found in lists] and len(lists) == 3, lists
    assert len(lists[0]) <= 14 and len(lists[1]) <= 4 and len(lists[2]) <= 5
    for path, name in (line for found in lists for line in found):
        module = importlib.import_module("gemma_spec_ros." + path.replace("/", "."))
        target = module
        for part in name.split("."):
            assert hasattr(target, part), f"{path}.py:{name} ({part} missing)"
            target = getattr(target, part)
        assert callable(target), f"{path}.py:{name}"
