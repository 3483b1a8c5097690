"""Load llama.cpp's libraries before anything else of a process (serve, the bench worker)."""


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
