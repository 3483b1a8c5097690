"""Summaries, markdown tables and PNG plots of a bench run's records.

Input is the list of per-run records the bench writes to ``results.json`` (one row each, see
:mod:`..record`); every figure here is derived from those records, so a committed results.json can
be re-plotted with ``gemma-spec-bench --report-only DIR``.

- :mod:`.summary`: the figures (same-run speedups, the per-runner summary, the comparisons);
- :mod:`.tables`: results.md and results_per_prompt.md;
- :mod:`.plots`: the PNGs;
- :mod:`.results_file`: results.json as written.
"""
from .plots import PLOTS, plot_all
from .results_file import dump_results, json_ready
from .summary import add_speedups, native_drafting_runners, rates_by_runner, summarize
from .tables import markdown, markdown_per_prompt

__all__ = ["PLOTS", "add_speedups", "dump_results", "json_ready", "markdown", "markdown_per_prompt",
           "native_drafting_runners", "plot_all", "rates_by_runner", "summarize"]
