"""The engine's parts import only downward, layer by layer: the base layer (config, errors, modes,
request, sampling, stats, ...) imports no part; ``llama/`` (the wrapper over llama.cpp) and ``grammar/`` only the base;
``drafters/`` the wrapper; ``policy/`` the drafters' evidence; ``chat/`` the grammar; ``remote/`` chat;
the generation loop (``engine.py``, ``propose.py``, ...) everything. A drafter that
reached up into the loop, or a wrapper that knew the cache format, fails here with its line. Imports
under ``if TYPE_CHECKING:`` (types for annotations only, nothing imported at run time) are not counted
there; no two modules import each other, in a loop of any length, even for a type."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ENGINE = Path(__file__).resolve().parents[2] / "gemma_spec_ros" / "gemma_spec_ros" / "engine"
PACKAGE = "gemma_spec_ros.engine"
BASE = {"config", "drafter_kinds", "errors", "files", "modes", "request", "sampling", "stats", "detokenize",
         "conversations"}
RANK = {"base": 0, "llama": 1, "grammar": 1, "drafters": 2, "policy": 3, "chat": 3, "remote": 4,
        "loop": 5}


def layer(module: str) -> str:
    """The layer of an engine module given relative to the engine (``drafters.lookup`` -> drafters)."""
    head = module.split(".")[0]
    if head in RANK:
        return head
    return "base" if head in BASE else "loop"


def engine_imports(path: Path, typing_too: bool = False) -> Iterator[Tuple[int, str]]:
    """(line, engine module relative to engine/) of every engine import in ``path`` (with
    ``typing_too``, those under ``if TYPE_CHECKING:`` as well)."""
    here = path.relative_to(ENGINE).with_suffix("").parts
    package = here[:-1]  # an __init__ is in its own folder's package, like any module there
    tree = ast.parse(path.read_text(), str(path))
    # imports under ``if TYPE_CHECKING:`` name types for annotations only: nothing runs upward
    typing_only = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for stmt in node.body for inner in ast.walk(stmt)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or (id(node) in typing_only and not typing_too):
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


def test_layers_are_told_apart() -> None:
    assert layer("drafters.lookup") == "drafters" and layer("config") == "base"
    assert layer("engine") == "loop" and layer("propose") == "loop"


def test_each_layer_imports_only_downward() -> None:
    sources = sorted(ENGINE.rglob("*.py"))
    assert len(sources) > 30, f"engine sources under {ENGINE}"
    offenders = []
    for path in sources:
        source = layer(".".join(path.relative_to(ENGINE).with_suffix("").parts))
        for line, target in engine_imports(path):
            into = layer(target)
            if into != source and RANK[into] >= RANK[source]:
                offenders.append(f"{path.relative_to(ENGINE)}:{line}: {source} imports {target} ({into})")
    assert not offenders, "an engine part imports upward or sideways:\n" + "\n".join(offenders)


def module_of(path: Path) -> str:
    """``path``'s module relative to engine/ (a package's __init__ is the package)."""
    parts = path.relative_to(ENGINE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The circles of ``graph`` (module -> modules it imports): each as a path back to its start."""
    circles: List[List[str]] = []
    done: Set[str] = set()

    def visit(module: str, path: List[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return circles


def test_circles_are_found() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_engine_modules_import_each_other() -> None:
    """A circle, even through a type named under TYPE_CHECKING, is two modules that know each
    other's insides (the loop's halves belong below both: steps.py under engine.py and slots.py)."""
    graph: Dict[str, Set[str]] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        here = module_of(path)
        graph[here] = {target for _, target in engine_imports(path, typing_too=True) if target != here}
    assert "steps" in graph["slots"] and "steps" in graph["engine"], "the loop's halves are below both"
    circles = import_circles(graph)
    assert not circles, "engine modules that import each other:\n" + "\n".join(" -> ".join(c) for c in circles)
