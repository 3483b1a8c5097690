"""``gemma-spec-bench``: the benchmark wing (see :mod:`.cli`).

- ``cli``: the command, the interleaved schedule, one record per run;
- ``config``: suites, params and the runner plan;
- ``worker``: one runner per process (engine, llama-cpp-python, the Generate action);
- ``native``: llama.cpp's own tools as runners;
- ``metrics`` and ``report``: pure figures, tables and plots.
"""
