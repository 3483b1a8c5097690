"""The lookup drafter's n-gram cache files: a cache path must name a regular file in a folder that
exists (a FIFO or /dev/zero is refused, never a hang), the learned cache is bounded whatever the
traffic, saved periodically and atomically, and moved aside when corrupt. No model.
Regressions at the engine level: each test names the defect it guards and fails on the code before
its fix."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest


def _lookup(dynamic_path: str = "", static_path: str = ""):
    from gemma_spec_ros.engine.config import LookupConfig
    return LookupConfig(static_path=static_path, dynamic_path=dynamic_path)


def _construct_in_thread(config, timeout: float = 20.0):
    """Build a LookupDrafter in a thread: (finished, exception). A hang shows as finished False."""
    from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
    outcome = {}

    def build() -> None:
        try:
            LookupDrafter(config).close()
            outcome["error"] = None
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(timeout)
    return "error" in outcome, outcome.get("error")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
@pytest.mark.parametrize("which", ["static", "dynamic"])
def test_cache_files_must_be_regular_files(tmp_path: Path, kind: str, which: str) -> None:
    """Defect 9: a cache path naming a FIFO, /dev/zero or a directory is refused with a reason,
    never a hang (before: a FIFO blocked configure forever, /dev/zero read until out of memory)."""
    from gemma_spec_ros.engine.errors import CacheFormatError
    if kind == "fifo":
        path = tmp_path / "cache.fifo"
        os.mkfifo(path)
    elif kind == "directory":
        path = tmp_path / "cache.d"
        path.mkdir()
    else:
        path = Path("/dev/zero")
    config = _lookup(**{f"{which}_path": str(path)})
    finished, error = _construct_in_thread(config)
    assert finished, f"LookupDrafter hung on a {kind} {which} cache"
    assert isinstance(error, CacheFormatError), error
    assert "regular file" in str(error) and str(path) in str(error)


def test_dynamic_cache_folder_must_exist(tmp_path: Path) -> None:
    """Defect 9: the dynamic cache's parent folder must exist (before: close created any folder)."""
    from gemma_spec_ros.engine.errors import CacheFormatError
    finished, error = _construct_in_thread(_lookup(str(tmp_path / "no" / "such" / "dynamic.bin")))
    assert finished and isinstance(error, CacheFormatError), error
    assert "does not exist" in str(error)
    assert not (tmp_path / "no").exists()


def _learn(lookup, rng, n_requests: int, length: int = 120) -> None:
    for _ in range(n_requests):
        tokens = rng.integers(3, 5000, size=length).tolist()
        lookup.begin(tokens[:10])
        lookup.end(tokens)


def test_dynamic_cache_is_bounded_and_keeps_what_recurs(tmp_path: Path) -> None:
    """Defect 3: the dynamic cache holds at most lookup.dynamic_max_ngrams n-grams whatever the
    traffic; n-grams that recur survive the eviction (before: every request's n-grams were kept
    forever)."""
    from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
    from gemma_spec_ros.engine.config import LookupConfig
    lookup = LookupDrafter(LookupConfig(dynamic_max_ngrams=2000, save_period=0))
    rng = np.random.default_rng(0)
    routine = [7, 8, 9, 10, 11, 12, 13, 14]
    for _ in range(40):
        lookup.begin(routine[:4])
        lookup.end(routine * 2)
        _learn(lookup, rng, 5)
        assert len(lookup.dynamic_cache) <= 2000
    assert lookup.dynamic_cache.get((7, 8, 9, 10)) == {11: 80}


def test_dynamic_cache_is_saved_periodically(tmp_path: Path) -> None:
    """Defect 3: with lookup.save_period the learned cache is saved while serving, atomically
    (before: only at cleanup/shutdown, so a crash lost everything learned)."""
    import time
    from gemma_spec_ros.engine.drafters import learned_cache
    from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
    from gemma_spec_ros.engine.config import LookupConfig
    path = tmp_path / "dynamic.bin"
    lookup = LookupDrafter(LookupConfig(dynamic_path=str(path), save_period=0.01))
    _learn(lookup, np.random.default_rng(1), 1)
    time.sleep(0.05)
    _learn(lookup, np.random.default_rng(2), 1)
    assert path.is_file() and learned_cache.load(path, "") == lookup.dynamic_cache
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_corrupt_learned_cache_is_moved_aside(tmp_path: Path) -> None:
    """Defect 3: a corrupt learned cache (one this engine wrote: it has the header) is moved aside
    with a warning and learning restarts (before: configure failed); a corrupt static cache still
    fails with its reason. Two corrupt files in the same second get two aside files."""
    from gemma_spec_ros.engine.drafters import learned_cache
    from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
    from gemma_spec_ros.engine.drafters.ngram_cache import NgramCache
    from gemma_spec_ros.engine.errors import CacheFormatError
    from gemma_spec_ros.engine.config import LookupConfig
    path = tmp_path / "dynamic.bin"
    corrupt = learned_cache.encode(NgramCache(), "") + b"\x01\x00\x00\x00garbage"
    for _ in range(2):
        path.write_bytes(corrupt)
        lookup = LookupDrafter(LookupConfig(dynamic_path=str(path)))
        assert len(lookup.dynamic_cache) == 0 and "moved it to" in lookup.warnings[0]
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 2 and all(p.read_bytes() == corrupt for p in aside)
    with pytest.raises(CacheFormatError, match="byte offset"):
        LookupDrafter(LookupConfig(static_path=str(aside[0])))
