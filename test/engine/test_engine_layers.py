"""The engine's rooms import only downward: the floor (config, errors, modes, request, sampling,
stats, ...) imports no room; ``llama/`` (the wrapper over llama.cpp) and ``grammar/`` only the floor;
``drafters/`` the wrapper; ``policy/`` the drafters' evidence; ``chat/`` the grammar; ``remote/`` chat;
the generation loop (``engine.py``, ``propose.py``, ...) everything. A drafter that
reached up into the loop, or a wrapper that knew the cache format, fails here with its line. Imports
under ``if TYPE_CHECKING:`` (types for annotations only, nothing imported at run time) are not counted."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

ENGINE = Path(__file__).resolve().parents[2] / "gemma_spec_ros" / "gemma_spec_ros" / "engine"
PACKAGE = "gemma_spec_ros.engine"
FLOOR = {"config", "errors", "files", "modes", "request", "sampling", "stats", "detokenize",
         "conversations"}
RANK = {"floor": 0, "llama": 1, "grammar": 1, "drafters": 2, "policy": 3, "chat": 3, "remote": 4,
        "loop": 5}


def room(module: str) -> str:
    """The room of an engine module given relative to the engine (``drafters.lookup`` -> drafters)."""
    head = module.split(".")[0]
    if head in RANK:
        return head
    return "floor" if head in FLOOR else "loop"


def engine_imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, engine module relative to engine/) of every engine import in ``path``."""
    here = path.relative_to(ENGINE).with_suffix("").parts
    package = here[:-1]  # an __init__ is in its own folder's package, like any module there
    tree = ast.parse(path.read_text(), str(path))
    # imports under ``if TYPE_CHECKING:`` name types for annotations only: nothing runs upward
    typing_only = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for stmt in node.body for inner in ast.walk(stmt)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
            continue
        if node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(base + ((node.module,) if node.module else ()))
        elif node.module and node.module.startswith(PACKAGE + "."):
            target = node.module[len(PACKAGE) + 1:]
        else:
            continue
        if target:
            yield node.lineno, target


def test_rooms_are_told_apart() -> None:
    assert room("drafters.lookup") == "drafters" and room("config") == "floor"
    assert room("engine") == "loop" and room("propose") == "loop"


def test_each_room_imports_only_downward() -> None:
    sources = sorted(ENGINE.rglob("*.py"))
    assert len(sources) > 30, f"engine sources under {ENGINE}"
    offenders = []
    for path in sources:
        source = room(".".join(path.relative_to(ENGINE).with_suffix("").parts))
        for line, target in engine_imports(path):
            into = room(target)
            if into != source and RANK[into] >= RANK[source]:
                offenders.append(f"{path.relative_to(ENGINE)}:{line}: {source} imports {target} ({into})")
    assert not offenders, "an engine room imports upward or sideways:\n" + "\n".join(offenders)
