"""The ROS 2 package itself: package.xml declares what the code imports, setup.py installs the
files ament expects where ament_index_python finds them, and the launch file / configs agree.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, Iterator, List, Set

import pytest

from gemma_spec_dev.bench.config import flatten  # how ROS names nested YAML keys
import yaml

PACKAGE = "gemma_spec_ros"
RIGS = "gemma_spec_dev"
REQUIRED_CONFIGS = ("embedded.yaml", "orin.yaml")
LAUNCH_FILE = "orin.launch.py"

#: Python modules that are not ROS packages -> their rosdep keys.
ROSDEP_KEY_OF_MODULE: Dict[str, str] = {
    "numpy": "python3-numpy",
    "yaml": "python3-yaml",
    "psutil": "python3-psutil",
    "matplotlib": "python3-matplotlib",
    "tqdm": "python3-tqdm",
    "jsonschema": "python3-jsonschema",
    "jinja2": "python3-jinja2",
}
#: Imported but installed with pip on every machine, so not a rosdep key (reason given).
PIP_ONLY: Dict[str, str] = {
    "llama_cpp": "llama-cpp-python is built from source per machine (CMAKE_ARGS, e.g. CUDA on "
                 "Orin) by scripts/setup.sh or the README's pip command; rosdep has no key for it",
    "llguidance": "the grammar engine of constrained output (abi3 wheels for x86_64 and aarch64 on "
                  "PyPI, installed by scripts/setup.sh or the README's pip command); no rosdep key",
    "safetensors": "read by gemma-spec-eagle3-convert (published EAGLE-3 heads); pip (scripts/setup.sh)",
    "gguf": "written by gemma-spec-eagle3-convert and the tests' tiny models; pip (scripts/setup.sh)",
    "langchain_core": "gemma_spec_dev.langchain_chat, an optional extra (pip install langchain-core) that "
                      "nothing else imports",
}
#: Imported by tests only and installed with pip (scripts/setup.sh), not a rosdep key (reason given).
TEST_PIP_ONLY: Dict[str, str] = {
    "fastapi": "llama-cpp-python[server]'s web stack, for a real llama.cpp server in the remote tests",
    "uvicorn": "llama-cpp-python[server]'s web stack",
    "pydantic_settings": "llama-cpp-python[server]'s web stack",
    "sse_starlette": "llama-cpp-python[server]'s web stack",
    "starlette_context": "llama-cpp-python[server]'s web stack",
    "langchain_tests": "LangChain's standard tests for chat models (test/tools/test_langchain_standard.py)",
    "pydantic": "LangChain's models of tool schemas (the standard tests' structured output)",
}
#: Test imports of ROS packages that rosdep knows by another name (the rqt plugins' modules).
ROS_KEY_OF_TEST_MODULE: Dict[str, str] = {"qt_gui": "qt_gui", "rqt_gui": "rqt_gui"}
MAINTAINER_EMAIL = "gemma-spec-ros@users.noreply.github.com"
PACKAGES = (PACKAGE, "gemma_spec_msgs", RIGS)
#: ROS packages that are not installed in the venv (not on PyPI) but exist on any ROS 2 install.
ROS_ONLY_ON_ROBOTS: Set[str] = {"launch", "launch_ros"}
ROS_NAME_SUFFIXES = ("_msgs", "_srvs", "_interfaces")
#: The files of gemma_spec_ros/ an install puts under share/gemma_spec_ros/ (same relative paths):
#: the SROS2 policy includes its profiles by relative path, so that layout must be kept.
SHARE_PATTERNS = ("launch/*.launch.py", "config/*.yaml", "config/aggregator/*.yaml", "config/schemas/*.json", "config/examples/*.json",
                  "config/sros2/*.xml", "config/sros2/common/*.xml", "config/sros2/common/node/*.xml",
                  "prompts/*.yaml")


# ---------- helpers ----------

def python_sources(package_dir: Path) -> List[Path]:
    """The Python code an ament_python package folder installs: its module and its launch files."""
    return (sorted((package_dir / package_dir.name).rglob("*.py"))
            + sorted((package_dir / "launch").glob("*.py")))


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception"}
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(t, ast.Name) and t.id in names for t in types):
            return True
    return False


def required_imports(tree: ast.AST) -> Iterator[str]:
    """Top-level names of absolute imports, skipping optional ones: inside ``try: ... except
    ImportError`` (the code works without them) or ``if TYPE_CHECKING:`` (never run)."""
    def walk(node: ast.AST, optional: bool) -> Iterator[str]:
        if isinstance(node, ast.Import) and not optional:
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not optional and node.level == 0 and node.module:
            yield node.module.split(".")[0]
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                child_optional = optional
                if isinstance(node, ast.Try) and field == "body" and _catches_import_error(node):
                    child_optional = True
                if isinstance(node, ast.If) and field == "body" and "TYPE_CHECKING" in ast.unparse(
                        node.test):
                    child_optional = True
                yield from walk(child, child_optional)

    yield from walk(tree, False)


def is_ros_package(module: str) -> bool:
    index = Path(sys.prefix) / "share" / "ament_index" / "resource_index" / "packages" / module
    return index.exists() or module in ROS_ONLY_ON_ROBOTS or module.endswith(ROS_NAME_SUFFIXES)


def declared_dependencies(package_xml: Path, *tags: str) -> Set[str]:
    root = ET.parse(package_xml).getroot()
    return {e.text.strip() for tag in tags for e in root.iter(tag) if e.text}


def runtime_dependencies(package_xml: Path) -> Set[str]:
    root = ET.parse(package_xml).getroot()
    return {e.text.strip() for tag in ("depend", "exec_depend") for e in root.iter(tag) if e.text}


def share_directory(venv_python: Path, ament_prefix_path: str) -> Path:
    """get_package_share_directory(PACKAGE) in a fresh interpreter with this AMENT_PREFIX_PATH."""
    env = dict(os.environ, AMENT_PREFIX_PATH=ament_prefix_path)
    out = subprocess.run(
        [str(venv_python), "-c",
         "from ament_index_python.packages import get_package_share_directory as g; "
         f"print(g({PACKAGE!r}))"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip().splitlines()[-1])


def assert_share_layout(share: Path, repo_root: Path) -> None:
    assert (share / "package.xml").is_file()
    for pattern in SHARE_PATTERNS:
        expected = {p.name for p in (repo_root / PACKAGE).glob(pattern)}
        assert expected, f"{PACKAGE}/{pattern} matches no file"
        installed = {p.name for p in share.glob(pattern)}
        assert expected <= installed, f"{pattern}: {sorted(expected - installed)} not installed"
    assert (share / "launch" / LAUNCH_FILE).is_file()
    for config in REQUIRED_CONFIGS:
        assert (share / "config" / config).is_file(), f"config/{config} not installed"


def copy_of_sources(repo_root: Path, destination: Path) -> Path:
    """The repository without build outputs and the venv: a clean tree to build from (building in
    the checkout would reuse a stale build/lib and race with `make setup`)."""
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "install", "log", "__pycache__",
                                    "*.egg-info", ".pytest_cache", "bench_out", "*.gguf")
    shutil.copytree(repo_root, destination, ignore=ignore, symlinks=True)
    return destination


# ---------- package.xml ----------

@pytest.mark.parametrize("package", [PACKAGE, RIGS])
def test_package_xml_is_format_3_and_matches_setup_py(repo_root: Path, package: str) -> None:
    root = ET.parse(repo_root / package / "package.xml").getroot()
    assert root.tag == "package" and root.get("format") == "3"
    assert root.findtext("name") == package
    assert root.findtext("export/build_type") == "ament_python"
    assert (repo_root / package / "resource" / package).is_file()
    setup_call = next(node for node in ast.walk(ast.parse((repo_root / package / "setup.py").read_text()))
                      if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    version = next(k.value for k in setup_call.keywords if k.arg == "version")
    assert isinstance(version, ast.Constant) and version.value == root.findtext("version")


def test_interface_package_xml(repo_root: Path) -> None:
    root = ET.parse(repo_root / "gemma_spec_msgs" / "package.xml").getroot()
    assert root.get("format") == "3"
    assert root.findtext("name") == "gemma_spec_msgs"
    assert root.findtext("export/build_type") == "ament_cmake"
    assert root.findtext("member_of_group") == "rosidl_interface_packages"


@pytest.mark.parametrize("package", [PACKAGE, RIGS])
def test_every_imported_package_is_declared(repo_root: Path, package: str) -> None:
    declared = runtime_dependencies(repo_root / package / "package.xml")
    missing: List[str] = []
    unknown: List[str] = []
    for source in python_sources(repo_root / package):
        where = source.relative_to(repo_root)
        for module in set(required_imports(ast.parse(source.read_text(), str(source)))):
            if module in sys.stdlib_module_names or module == package or module in PIP_ONLY:
                continue
            if module in ROSDEP_KEY_OF_MODULE:
                key = ROSDEP_KEY_OF_MODULE[module]
            elif is_ros_package(module):
                key = module
            else:
                unknown.append(f"{where}: {module}")
                continue
            if key not in declared:
                missing.append(f"{where}: import {module} needs <exec_depend>{key}</exec_depend>")
    assert not unknown, ("imports of unknown packages; add each to ROSDEP_KEY_OF_MODULE (and "
                         f"package.xml) or PIP_ONLY in this test: {unknown}")
    assert not missing, "\n".join(missing)


def test_every_test_import_is_declared(repo_root: Path) -> None:
    """The dev suite (test/) and the package's own tests (gemma_spec_ros/test/) import only what
    gemma_spec_ros/package.xml declares (test_depend, or a runtime dependency) or what pip
    installs for them (TEST_PIP_ONLY); the timeout marks need python3-pytest-timeout."""
    declared = declared_dependencies(repo_root / PACKAGE / "package.xml", "depend", "exec_depend", "test_depend")
    local = {"support", "conftest", PACKAGE, RIGS}
    missing: List[str] = []
    sources = sorted((repo_root / "test").rglob("*.py")) + sorted((repo_root / PACKAGE / "test").glob("*.py"))
    for source in sources:
        where = source.relative_to(repo_root)
        text = source.read_text()
        modules = set(required_imports(ast.parse(text, str(source))))
        if "mark.timeout" in text:
            modules.add("pytest_timeout")
        for module in sorted(modules - local):
            if module in sys.stdlib_module_names or module in PIP_ONLY or module in TEST_PIP_ONLY:
                continue
            key = (ROSDEP_KEY_OF_MODULE.get(module) or ROS_KEY_OF_TEST_MODULE.get(module)
                   or {"pytest": "python3-pytest", "pytest_timeout": "python3-pytest-timeout"}.get(module)
                   or (module if is_ros_package(module) or module.startswith(("ros2", "rqt_", "ament_", "python_qt"))
                       else None))
            if key is None:
                missing.append(f"{where}: import {module}: add it to TEST_PIP_ONLY (with the reason) or package.xml")
            elif key not in declared:
                missing.append(f"{where}: import {module} needs <test_depend>{key}</test_depend>")
    assert not missing, "\n".join(missing)


def test_robot_dependencies_are_declared(repo_root: Path) -> None:
    """What the README runs on a robot beyond the code's imports: ros2 launch, the aggregator."""
    declared = runtime_dependencies(repo_root / PACKAGE / "package.xml")
    assert {"ros2launch", "diagnostic_aggregator", "launch", "launch_ros"} <= declared


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_carries_the_license_it_declares(repo_root: Path, package: str) -> None:
    root = ET.parse(repo_root / package / "package.xml").getroot()
    assert root.findtext("license") == "Apache-2.0"
    license_text = (repo_root / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert (repo_root / package / "LICENSE").read_text() == license_text


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_names_a_reachable_maintainer_and_its_url(repo_root: Path, package: str) -> None:
    root = ET.parse(repo_root / package / "package.xml").getroot()
    assert root.find("maintainer").get("email") == MAINTAINER_EMAIL
    assert any(url.text.startswith("https://") for url in root.iter("url") if url.get("type") == "repository")
    setup_py = repo_root / package / "setup.py"
    if setup_py.exists():
        assert f'maintainer_email="{MAINTAINER_EMAIL}"' in setup_py.read_text()


def test_import_scan_sees_what_it_should() -> None:
    code = ("import os, numpy.linalg\nfrom rclpy.node import Node\nfrom . import engine\n"
            "try:\n    import psutil\nexcept ImportError:\n    psutil = None\n"
            "if TYPE_CHECKING:\n    import llama_cpp\n"
            "def f() -> None:\n    import gemma_spec_msgs.msg\n")
    assert sorted(set(required_imports(ast.parse(code)))) == [
        "gemma_spec_msgs", "numpy", "os", "rclpy"]


# ---------- launch file and configs ----------

def test_launch_file_is_conventional(repo_root: Path) -> None:
    source = (repo_root / PACKAGE / "launch" / LAUNCH_FILE).read_text()
    tree = ast.parse(source, feature_version=(3, 10))  # Humble's Python
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "generate_launch_description" in functions
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    strings = {node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    keywords = {node.arg for node in ast.walk(tree) if isinstance(node, ast.keyword)}
    assert {"LifecycleNode", "DeclareLaunchArgument", "OpaqueFunction", "NODE_NAME"} <= names
    assert {"params_file", "models_dir", "spec_mode", "respawn", "autostart", "--autostart", "orin.yaml",
            "enclave", "ROS_SECURITY_ENCLAVE_OVERRIDE",
            "gemma_spec_node", "spec.mode", "target.model_path", "draft.model_path"} <= strings
    # the node configures + activates itself at each process start (a launch-side configure was
    # lost after kill -9); launch's SIGTERM / SIGKILL come after the node's shutdown bound
    assert {"respawn", "respawn_delay", "sigterm_timeout", "sigkill_timeout", "arguments",
            "additional_env"} <= keywords


def test_launch_arguments_override_the_right_parameters(repo_root: Path) -> None:
    """The launch file's pure override logic, run without launch/launch_ros (not installable
    here): its constants and ``parameter_overrides`` are executed on their own."""
    tree = ast.parse((repo_root / PACKAGE / "launch" / LAUNCH_FILE).read_text())
    kept = [node for node in tree.body
            if isinstance(node, ast.Assign)
            or (isinstance(node, ast.FunctionDef) and node.name == "parameter_overrides")]
    namespace: Dict[str, object] = {"os": os, "Any": object, "Dict": Dict, "SHUTDOWN_BOUND": 20.0}
    exec(compile(ast.Module(body=kept, type_ignores=[]), LAUNCH_FILE, "exec"), namespace)
    overrides = namespace["parameter_overrides"]
    assert overrides("", "") == {}
    assert overrides("", "lookup") == {"spec.mode": "lookup"}
    assert overrides("/opt/models", "") == {
        "target.model_path": "/opt/models/gemma-3-4b-it-q4_0.gguf",
        "draft.model_path": "/opt/models/gemma-3-1b-it-q4_0.gguf",
    }


@pytest.mark.parametrize("config", REQUIRED_CONFIGS)
def test_config_is_a_ros_parameter_file(repo_root: Path, config: str) -> None:
    path = repo_root / "gemma_spec_ros" / "config" / config
    assert path.is_file(), f"config/{config} is missing"
    document = yaml.safe_load(path.read_text())
    assert list(document) == ["/**"], "parameters apply to the node under any name: '/**'"
    parameters = flatten(document["/**"]["ros__parameters"])
    # the names the launch file overrides and the README documents
    assert {"spec.mode", "target.model_path"} <= set(parameters)
    if config == "orin.yaml":
        assert "draft.model_path" in parameters


# ---------- installation ----------

@pytest.fixture(scope="module")
def pip_prefix(repo_root: Path, venv_python: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, non-editable ``pip install`` of setup.py into a fresh prefix."""
    tmp = tmp_path_factory.mktemp("pip_install")
    source = copy_of_sources(repo_root, tmp / "src")
    prefix = tmp / "prefix"
    out = subprocess.run(
        # --ignore-installed: otherwise pip uninstalls the venv's own (editable) gemma_spec_ros
        # before installing into the prefix, breaking every later test and `make run`.
        [str(venv_python), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--ignore-installed", "--disable-pip-version-check", "--no-cache-dir", "-q",
         "--prefix", str(prefix), str(source / PACKAGE)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return prefix


@pytest.mark.timeout(300)
def test_pip_install_puts_share_files_where_ament_finds_them(
        pip_prefix: Path, repo_root: Path, venv_python: Path) -> None:
    resource = pip_prefix / "share" / "ament_index" / "resource_index" / "packages" / PACKAGE
    assert resource.is_file()
    share = share_directory(venv_python, str(pip_prefix))
    assert share == pip_prefix / "share" / PACKAGE
    assert_share_layout(share, repo_root)
    python = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = pip_prefix / "lib" / python / "site-packages"
    assert (site / PACKAGE / "engine" / "config.py").is_file()
    assert (site / PACKAGE / "engine" / "drafters" / "lookup.py").is_file()  # the sub-folders too


@pytest.mark.timeout(300)
def test_colcon_style_install_puts_the_executable_where_ros2_launch_finds_it(
        repo_root: Path, venv_python: Path, tmp_path: Path) -> None:
    """colcon builds ament_python packages with ``setup.py ... install``, which honours
    setup.cfg's ``install_scripts``: ``ros2 run/launch`` look in ``<prefix>/lib/<package>``."""
    source = copy_of_sources(repo_root, tmp_path / "src")
    prefix, build = tmp_path / "prefix", tmp_path / "build"
    build.mkdir()
    out = subprocess.run(
        [str(venv_python), "setup.py", "-q", "egg_info", "--egg-base", str(build),
         "build", "--build-base", str(build), "install", "--prefix", str(prefix),
         "--record", str(build / "install.log"), "--single-version-externally-managed"],
        cwd=source / PACKAGE, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    node = prefix / "lib" / PACKAGE / "gemma_spec_node"
    assert node.is_file() and os.access(node, os.X_OK), sorted(map(str, prefix.rglob("*")))[:40]
    # The launch file drives configure/activate itself: this executable must not autostart.
    entry_points = "".join(p.read_text() for p in prefix.rglob("entry_points.txt"))
    assert "gemma_spec_node = gemma_spec_ros.tools.serve:node_main" in entry_points
    assert_share_layout(share_directory(venv_python, str(prefix)), repo_root)


def test_venv_exposes_the_package_to_ament(repo_root: Path, venv_python: Path) -> None:
    """scripts/setup.sh links the share files into the venv (like colcon --symlink-install)."""
    share = share_directory(venv_python, sys.prefix)
    assert share == Path(sys.prefix) / "share" / PACKAGE
    assert_share_layout(share, repo_root)
