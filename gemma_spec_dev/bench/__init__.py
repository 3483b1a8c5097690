"""``gemma-spec-bench``: the benchmark wing (see :mod:`.cli`).

- ``cli``: the command, the interleaved schedule, one record per run;
- ``config``: suites, params and the runner plan;
- ``worker``: one runner per process (engine, llama-cpp-python, the Generate action);
- ``native``: llama.cpp's own tools as runners;
- ``runner``: the Runner protocol and the RunResult every runner returns;
- ``metrics`` and ``report``: pure figures, tables and plots.
"""
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``gemma-spec-bench`` (:func:`.cli.main`); imported on call, so that importing the worker
    module loads nothing before llama_cpp."""
    from .cli import main as cli_main

    return cli_main(argv)
