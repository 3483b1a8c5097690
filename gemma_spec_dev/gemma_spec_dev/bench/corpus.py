"""Prompts nobody tuned for: beginnings of text files drawn at run time from a corpus folder.

``gemma-spec-bench --random-prompts N --corpus DIR --seed S`` adds a suite ``random`` of N prompts.
Each is a window of a text file under DIR (source code, docs, data: whatever the folder holds),
starting at a line boundary, cut at a line boundary to between ``min_chars`` and ``max_chars``
characters. The draw depends only on the files (their relative paths and contents) and the seed,
so a run can be repeated, yet nobody can pick prompts that suit the engine: the suite is drawn
after the code is written. The default corpus is the interpreter's standard library plus the
installed packages (``sysconfig``'s ``stdlib`` and ``purelib``): Python code and docstrings in
many styles that the project's own prompt suites never saw.

A prompt's id names its file and line (``<relative path>:<line>``), so any result can be traced
back to its text.
"""
from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .config import Prompt, Suite

#: Text files worth drawing from (others, binaries above all, are never read).
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini",
                 ".c", ".h", ".cpp", ".hpp", ".js", ".ts", ".html", ".css", ".sh", ".xml", ".csv")
SUITE_NAME = "random"
MAX_FILE_BYTES = 2_000_000


def default_corpus() -> List[Path]:
    """The standard library and the installed packages of this interpreter."""
    paths = sysconfig.get_paths()
    found: List[Path] = []
    for key in ("stdlib", "purelib"):
        path = Path(paths.get(key, ""))
        if path.is_dir() and path not in found:
            found.append(path)
    return found


def corpus_files(roots: Sequence[Path], exclude: Sequence[Path] = ()) -> List[Tuple[Path, str]]:
    """(file, name relative to its root) of every text file under ``roots``, sorted by name, leaving
    out files under ``exclude`` (the project's own prompt suites) and files over MAX_FILE_BYTES."""
    excluded = [e.resolve() for e in exclude if e.exists()]
    files: List[Tuple[Path, str]] = []
    for root in roots:
        root = root.resolve()
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            here = Path(folder)
            if any(here == e or e in here.parents for e in excluded):
                dirs[:] = []
                continue
            for name in sorted(names):
                path = here / name
                if path.suffix.lower() not in TEXT_SUFFIXES or not path.is_file() or path.is_symlink():
                    continue
                if 0 < path.stat().st_size <= MAX_FILE_BYTES:
                    files.append((path, f"{root.name}/{path.relative_to(root)}"))
    files.sort(key=lambda item: item[1])
    return files


def window(text: str, rng: random.Random, min_chars: int, max_chars: int) -> Optional[Tuple[int, str]]:
    """(1-based line, text) of a window of ``text`` starting at a random line and ending at a line
    boundary, ``min_chars``..``max_chars`` long and mostly printable; None if the file has none.

    >>> window("a\\n" * 100, random.Random(0), 10, 20)[1]
    'a\\na\\na\\na\\na\\na\\na\\na\\na\\na\\n'
    """
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip()]
    for _ in range(8):
        if not starts:
            return None
        first = rng.choice(starts)
        chunk = ""
        for line in lines[first:]:
            if len(chunk) + len(line) > max_chars:
                break
            chunk += line
        if len(chunk) < min_chars:
            continue
        printable = sum(ch.isprintable() or ch in "\n\t" for ch in chunk)
        if printable >= 0.98 * len(chunk) and len(chunk.split()) >= 20:
            return first + 1, chunk
    return None


def random_suite(n: int, roots: Sequence[Path], seed: int, exclude: Sequence[Path] = (),
                 min_chars: int = 400, max_chars: int = 1200) -> Suite:
    """A suite of ``n`` prompts drawn from the text files under ``roots`` (see the module docstring);
    ValueError if the corpus cannot give ``n`` distinct prompts."""
    if n < 1:
        raise ValueError(f"--random-prompts {n}: must be >= 1")
    files = corpus_files(roots, exclude)
    if not files:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES[:6])}, ...) under "
                         f"{', '.join(str(r) for r in roots)}")
    rng = random.Random(seed)
    prompts: List[Prompt] = []
    seen = set()
    for _ in range(50 * n):
        if len(prompts) == n:
            break
        path, name = rng.choice(files)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        drawn = window(text, rng, min_chars, max_chars)
        if drawn is None or (name, drawn[0]) in seen:
            continue
        seen.add((name, drawn[0]))
        prompts.append(Prompt(SUITE_NAME, f"{name}:{drawn[0]}", drawn[1]))
    if len(prompts) < n:
        raise ValueError(f"the corpus gave {len(prompts)} of {n} prompts: pass a larger --corpus")
    return Suite(SUITE_NAME, f"{n} prompt beginnings drawn at run time (seed {seed}) from "
                             f"{', '.join(str(r) for r in roots)}", 1000, tuple(prompts))
