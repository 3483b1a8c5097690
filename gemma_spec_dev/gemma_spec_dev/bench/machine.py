"""What a bench run was measured on: the machine, the library versions, the source tree's commit,
llama.cpp's build flavour (results.json's ``machine`` and ``config.llama_build``)."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Optional


def machine_info() -> Dict[str, Any]:
    """What the numbers were measured on."""
    cpu = ""
    mem_gib = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
            mem_gib = round(kib / 2 ** 20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    versions = {}
    for dist in ("llama_cpp_python", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "mem_gib": mem_gib,
            "python": platform.python_version(), "versions": versions, "git_commit": _git_commit(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def llama_build() -> Optional[str]:
    """``exact`` (no llamafile sgemm: batch-invariant F16/F32 logits) or ``fast``; None if llama.cpp
    does not load here."""
    try:
        from gemma_spec_ros.engine.llama.process import batch_invariant_build
        return "exact" if batch_invariant_build() else "fast"
    except Exception:  # noqa: BLE001 - a header detail, never a reason to lose the results
        return None


def _git_commit() -> Optional[str]:
    """Short commit of the source tree, '+dirty' when it has uncommitted changes; None outside git."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None
