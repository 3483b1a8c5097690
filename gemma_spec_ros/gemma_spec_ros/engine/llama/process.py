"""Process-wide state of llama.cpp and of the C heap under it: backend init, the log filter,
malloc arenas and trimming, and which build (exact or fast) this process loaded.

Everything here acts on the whole process, not on one model; ``backend.LlamaModel`` and the MTP
drafter call ``init_backend`` before their first llama.cpp call.
"""
from __future__ import annotations

import ctypes
import os
import threading

_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False


def load_llama_cpp():  # imported lazily so that importing the engine package never needs llama_cpp
    import llama_cpp  # noqa: WPS433

    return llama_cpp


def init_backend() -> None:
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            llama_cpp = load_llama_cpp()
            llama_cpp.llama_backend_init()
            if not os.environ.get("GEMMA_SPEC_LLAMA_LOG"):
                # llama.cpp logs every load at INFO on stderr; keep errors only.
                _install_quiet_logger(llama_cpp)
            _BACKEND_READY = True


#: glibc's mallopt parameter for the most malloc arenas (malloc.h: M_ARENA_MAX = -8).
_M_ARENA_MAX = -8


def limit_malloc_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas at ``count`` (call it before starting threads); False where there
    is no glibc or ``MALLOC_ARENA_MAX`` is set (the user's choice wins).

    A node loads and frees its models from whichever executor thread runs the transition, and glibc
    gives each thread its own arena (up to 8 per core): a model's allocations then land in a new
    arena at each cleanup/configure cycle and the freed ones stay fragmented. Measured on the
    embedded model: anonymous RSS +2.6 MiB per cycle without the cap (after ``malloc_trim``), flat
    with 2 arenas (40 cycles). The generation runs in one thread, so the cap costs no speed.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, count))


def batch_invariant_build() -> bool:
    """Whether this llama.cpp build gives a position the same logits whatever the batch around it,
    for F16/F32 weights on the CPU: built without llamafile's sgemm (``GEMMA_SPEC_LLAMA_BUILD=exact``,
    the default of scripts/setup.sh). With it (``fast``) multi-row products sum in another order
    (up to ~0.02 of a logit, measured on F16): speculative output then equals plain output except
    at near-ties, which is not a promise."""
    init_backend()
    return b"LLAMAFILE = 1" not in load_llama_cpp().llama_print_system_info()


def exact_output_expected(ftype: int) -> bool:
    """Whether output of a model with llama.cpp file type ``ftype`` is promised bit-identical
    whatever the batch shapes and rollbacks: under the exact build (every batch size gives the same
    F16/F32 logits), or with unquantized weights (prompt reuse is promised bit-identical there)."""
    llama_cpp = load_llama_cpp()
    unquantized = ftype in (llama_cpp.LLAMA_FTYPE_ALL_F32, llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
                            llama_cpp.LLAMA_FTYPE_MOSTLY_BF16)
    return unquantized or batch_invariant_build()


def return_freed_memory() -> bool:
    """Give the heap pages freed so far back to the OS (glibc ``malloc_trim``); False where there is
    no glibc. Freeing a model and its context (KV cache, compute buffers: hundreds of MiB) leaves
    the pages in glibc's arenas, so without this each cleanup/configure cycle of a long-running
    node added tens of MiB of resident memory, ~180 MiB after 5 cycles (measured)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


_LOG_CALLBACK = None  # keep a reference: llama.cpp holds the C pointer
_GGML_LOG_LEVEL_ERROR = 4  # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5


def _install_quiet_logger(llama_cpp) -> None:
    global _LOG_CALLBACK

    @llama_cpp.llama_log_callback
    def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == _GGML_LOG_LEVEL_ERROR:
            try:
                os.write(2, text)
            except OSError:
                pass

    _LOG_CALLBACK = _quiet
    llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))


def import_llama_cpp_first() -> bool:
    """Import llama_cpp now, before rclpy, numpy or yaml: the reverse order segfaulted a CUDA build
    (on the bench's GPU machine; see docs/benchmarks.md). Call it at the top of a process's main
    module, before those imports. False if llama_cpp is not installed: the node reports that at
    configure, with the reason, and the bench's action runner does not need it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True
