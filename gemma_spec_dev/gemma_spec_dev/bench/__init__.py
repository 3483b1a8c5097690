"""``gemma-spec-bench``: the benchmark wing (see :mod:`.cli`).

- ``cli``: the command and the interleaved schedule;
- ``config``: suites, params and the runner plan;
- ``worker``: one runner per process (engine, llama-cpp-python, the Generate action), and
  ``worker_handle``, the parent's side of it;
- ``native``: llama.cpp's own tools as runners; ``remote``: an OpenAI-compatible server as one;
- ``runner``: the Runner protocol, the RunResult every runner returns, the Timeline it measures with;
- ``record``: one row of results.json per run; ``machine``: what the run was measured on;
- ``metrics`` and ``report``: pure figures, tables and plots;
- ``constrained``: ``gemma-spec-bench-constrained``, the planner suite under its JSON schema.
"""
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``gemma-spec-bench`` (:func:`.cli.main`); imported on call, so that importing the worker
    module loads nothing before llama_cpp."""
    from .cli import main as cli_main

    return cli_main(argv)
