"""The tests of bit-identical output, run under llama.cpp's exact build.

The default build (``GEMMA_SPEC_LLAMA_BUILD=fast``, llama.cpp's own default: llamafile's sgemm) sums
multi-row products in another order than a one-token decode, so speculative output equals plain
output only up to near-ties, and the tests marked ``exact`` skip under it. `make test` unpacks the
``exact`` build (no sgemm) into ``$VENV/opt/llama-cpp-exact`` (scripts/setup.sh with
GEMMA_SPEC_EXACT_SIDE=1); this test runs the ``exact`` tests in a child pytest with that build first
on PYTHONPATH, and fails unless every one of them ran there and passed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.junit import junit_counts

EXACT_FILES = ("test/engine/test_engine_on_real_models.py", "test/engine/test_prompt_reuse.py",
               "test/engine/test_sliding_window.py", "test/engine/test_linked_heads.py",
               "test/engine/test_grammar.py", "test/engine/test_hindsight.py", "test/engine/test_eagle3.py",
               "test/engine/test_suffix_engine.py",
               "test/engine/test_slots.py", "test/engine/test_chat_engine.py",
               "test/engine/test_lossless_after_workload.py", "test/engine/test_eagle3_gemma3.py")


def exact_llama_dir() -> Path:
    """Where scripts/setup.sh unpacks the exact build (``$GEMMA_SPEC_EXACT_LLAMA`` overrides)."""
    return Path(os.environ.get("GEMMA_SPEC_EXACT_LLAMA") or Path(sys.prefix) / "opt" / "llama-cpp-exact")


@pytest.mark.timeout(1800)
def test_bit_identical_output_under_the_exact_build(repo_root: Path, venv_python: Path, tmp_path: Path) -> None:
    from gemma_spec_ros.engine.llama.process import batch_invariant_build
    if batch_invariant_build():
        pytest.skip("this session's llama.cpp build is the exact one: the tests marked exact run in it directly")
    folder = exact_llama_dir()
    if not (folder / "llama_cpp" / "__init__.py").is_file():
        missing = f"no exact llama.cpp build at {folder}: `make test` unpacks it (GEMMA_SPEC_EXACT_SIDE=1 bash scripts/setup.sh)"
        # make test asked setup for it, which skips it only for custom flags (LLAMA_CMAKE_ARGS,
        # e.g. a CUDA build): otherwise its absence is a setup fault
        if os.environ.get("GEMMA_SPEC_EXACT_SIDE") == "1" and not os.environ.get("LLAMA_CMAKE_ARGS"):
            pytest.fail(missing)
        pytest.skip(missing)
    report = tmp_path / "exact.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in [env.get("PYTHONPATH", "")] if p])
    # the child must load the exact build, or its exact tests would skip (counted below as failure)
    probe = subprocess.run(
        [str(venv_python), "-c", "import llama_cpp; print(llama_cpp.__file__)"],
        env=env, cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert Path(probe.stdout.strip()).resolve().is_relative_to(folder.resolve()), probe.stdout
    proc = subprocess.run(
        [str(venv_python), "-m", "pytest", "-m", "exact", "-q", "-rs", "-p", "no:cacheprovider",
         f"--junitxml={report}", *EXACT_FILES],
        env=env, cwd=repo_root, capture_output=True, text=True, timeout=1700)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    counts = junit_counts(report)
    # 4 greedy modes, the seeded sampling test, the prompt-reuse test, speculation past the
    # sliding-window ring (greedy, seeded), MTP's greedy and seeded tests, constrained output's
    # greedy and seeded tests, shadow drafting's greedy and seeded tests, EAGLE-3's greedy and
    # seeded tests (in the minimal loop and through the engine); the suffix drafter's greedy, seeded,
    # constrained greedy and seeded tests and its prompt-reuse test; a chat turn in each of the 7
    # modes a draft model allows
    assert counts["tests"] >= 30, (counts, tail)
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, tail)
