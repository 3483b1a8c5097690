"""engine/ is the ROS-free core: it imports numpy, llama_cpp and the standard library,
never rclpy, message packages, launch or ament. The bench and plain-Python users rely on it."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Iterator, List, Tuple

ENGINE = Path(__file__).resolve().parents[2] / "gemma_spec_ros" / "gemma_spec_ros" / "engine"
FORBIDDEN_EXACT = ("rclpy", "rcl_interfaces", "rosidl_runtime_py", "builtin_interfaces")
FORBIDDEN_PREFIXES = ("launch", "ament", "rcl")
FORBIDDEN_SUFFIXES = ("_msgs", "_srvs", "_interfaces")


def is_ros(module: str) -> bool:
    top = module.split(".")[0]
    return (top in FORBIDDEN_EXACT or top.startswith(FORBIDDEN_PREFIXES)
            or top.endswith(FORBIDDEN_SUFFIXES))


def imported_modules(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, module) of every absolute import, anywhere in the file (functions included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def engine_modules() -> List[str]:
    """Every module under engine/, sub-folders included (``engine.drafters.lookup``, ...)."""
    return sorted("gemma_spec_ros.engine." + ".".join(p.relative_to(ENGINE).with_suffix("").parts)
                  for p in ENGINE.rglob("*.py") if p.stem != "__init__")


def test_rules_catch_ros_imports() -> None:
    assert all(map(is_ros, ["rclpy.node", "gemma_spec_msgs.msg", "launch_ros.actions",
                            "ament_index_python.packages", "lifecycle_msgs", "rcl_interfaces.msg",
                            "example_interfaces.action", "std_srvs.srv"]))
    assert not any(map(is_ros, ["numpy", "llama_cpp", "os.path", "threading", "math"]))


def test_engine_sources_import_nothing_from_ros() -> None:
    sources = sorted(ENGINE.rglob("*.py"))
    assert {p.parent.name for p in sources} >= {"engine", "llama", "drafters", "policy", "grammar",
                                                "chat", "remote"}, f"engine sources under {ENGINE}"
    offenders = [f"{path.relative_to(ENGINE)}:{line}: {module}"
                 for path in sources
                 for line, module in imported_modules(ast.parse(path.read_text(), str(path)))
                 if is_ros(module)]
    assert not offenders, "engine/ must stay ROS-free:\n" + "\n".join(offenders)


def test_importing_the_engine_loads_no_ros(venv_python: Path) -> None:
    """Transitive imports count too: a fresh interpreter imports every engine module."""
    modules = ["gemma_spec_ros.engine"] + engine_modules()
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([str(venv_python), "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "gemma_spec_ros.engine.drafters.lookup" in loaded
    assert not [m for m in loaded if is_ros(m)], [m for m in loaded if is_ros(m)]
