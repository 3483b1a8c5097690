"""``gemma-spec-soak``: run ``gemma-spec-serve`` as a subprocess and drive it like a busy robot.

    gemma-spec-soak --params-file config/embedded.yaml --goals 5000 --clients 3 --out soak/ \\
        --set target.n_threads:=2

What it does (seeded, so a run can be repeated):

- ``--clients`` threads send ``--goals`` goals in all: valid ones (greedy, seeded-sampled, chat
  template, stop lists, prompts near the limits, priorities, small JSON Schemas), hostile ones
  (``--hostile-share``: an ambiguous grammar, a recursive anyOf schema, a maxLength 20000 schema, a
  grammar nested up to ``limits.max_grammar_bytes``, in turn), which the node may refuse or serve,
  and invalid ones of every kind the node must refuse; every goal but the invalid ones carries
  ``--goal-budget``; a share of the accepted goals is cancelled at a random point: in the goal-response
  callback, right after acceptance (queued or in prompt evaluation), mid-stream after k feedback
  messages, or after a random delay (near or after the last feedback);
- a parameter thread sets runtime parameters every ``--flip-period`` seconds (valid values, which
  must be accepted, and invalid ones, default constraints that do not parse among them, which must
  be refused with a reason) and runs the lifecycle
  cycles (``--cycles`` deactivate/activate, ``--cleanup-cycles`` cleanup/configure/activate, and
  with ``--remote-phase`` a phase on ``backend: remote`` with a real llama-server frozen by SIGSTOP
  for ``--freeze`` seconds: see :mod:`.remote_phase`);
- ``--chat-share`` of the goals are chat turns (GenerateChat) with tools: every ``tool_choice``,
  follow-ups carrying an earlier call and its result, malformed turns the node must refuse, and
  turns built to cost the goal check time;
- the fresh-engine check (soak/fresh.py): reference requests (prompts seen and unseen, chat turns;
  greedy, ``off``, prompt reuse as configured) answered by a fresh engine of the node's configuration
  in this process, then by the node at the start, after each lifecycle cycle and at the end; every
  answer must be the fresh engine's text, or part from it only at a near-tie;
- at the end it sends a few goals and, with them running and queued, stops the server with SIGINT.

Checks (each PASS/FAIL in the report): every accepted goal got one result (0 lost); every goal
response within 1 s of its request; every result within its budget + 5 s; every invalid goal and
parameter refused (rejections counted on /diagnostics and logged, refusals with a reason); a goal
whose cancel was accepted ended CANCELED (or SUCCEEDED if it finished first); every schema goal that
ended ``stop`` is JSON valid for its schema (jsonschema); every call of an accepted chat turn names
an offered tool and validates against its schema, and a turn that must call ended with calls; every
malformed chat turn refused (or ended with an error); streamed text equals the result text; the same
greedy output at the end as at the start; the fresh-engine check at every point; exit status 0;
the dynamic cache file valid afterwards.
Opt-in checks for long runs: ``--max-rss-slope`` (RSS slope after warm-up) and ``--cancel-bound``
(p99 cancel-to-result within one prompt chunk + 2 target passes, both taken from the results' own
timings: p99 of prompt time per ``n_batch`` chunk and of verify time per pass).

Measures: latency, queue wait and cancel-to-result p50/p95/p99; the server's RSS (total, anonymous,
file-backed), threads and open files every ``--sample-period`` seconds with their slope (per 1,000
goals and per hour, after ``--warmup`` goals, leaving out samples taken during a cleanup cycle);
the dynamic cache's n-grams (from /diagnostics). Writes ``soak.json``,
``soak.md`` and ``rss.svg`` to ``--out``; a progress bar on stderr. Exit status 0 if every check
passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from . import remote_phase
from .driver import Soak
from .report import build_report, render_markdown, render_svg


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gemma-spec-soak", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-file", action="append", default=[], metavar="YAML",
                        help="the server's parameters file(s)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME:=VALUE",
                        help="a server parameter override (repeatable)")
    parser.add_argument("--node-name", default="gemma_spec_soak")
    parser.add_argument("--goals", type=int, default=300)
    parser.add_argument("--duration", type=float, default=0.0, metavar="SECONDS",
                        help="keep sending goals until this long has passed, even past --goals")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--invalid-share", type=float, default=0.15)
    parser.add_argument("--hostile-share", type=float, default=0.05,
                        help="share of the other goals whose constraint attacks the grammar engine")
    parser.add_argument("--schema-share", type=float, default=0.1,
                        help="share of the remaining goals constrained by a small JSON Schema")
    parser.add_argument("--goal-budget", type=float, default=30.0, metavar="SECONDS",
                        help="time_budget of every goal but the invalid ones (checked: result within "
                             "budget + 5 s)")
    parser.add_argument("--chat-share", type=float, default=0.3,
                        help="share of goals that are GenerateChat turns (valid ones with tools: required, "
                             "auto, none, a tool's name, follow-ups with tool results; malformed and hostile "
                             "ones); the node gets the agent suite's chat template unless --set names one")
    parser.add_argument("--no-fresh-check", dest="fresh_check", action="store_false",
                        help="skip the fresh-engine check (reference requests against a fresh engine in this "
                             "process, at the start, after each lifecycle cycle and at the end)")
    parser.add_argument("--cancel-share", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens of a valid goal")
    parser.add_argument("--flip-period", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN", "MAX"))
    parser.add_argument("--cycles", type=int, default=2, help="deactivate/activate cycles")
    parser.add_argument("--cleanup-cycles", type=int, default=1, help="cleanup/configure cycles")
    parser.add_argument("--final-goals", type=int, default=3,
                        help="goals running and queued when SIGINT stops the server")
    parser.add_argument("--sample-period", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=50, help="goals before the slopes are fitted")
    parser.add_argument("--goal-timeout", type=float, default=300.0)
    parser.add_argument("--result-resend", type=float, default=20.0,
                        help="seconds without a result before the result is requested again "
                             "(below the node's queue.result_timeout, 60 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak", help="folder for soak.json, soak.md, rss.svg, serve.log")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--max-rss-slope", type=float, default=None, metavar="MIB",
                        help="check: RSS slope after warm-up below MIB per 1,000 goals (default: reported only)")
    parser.add_argument("--cancel-bound", action="store_true",
                        help="check: p99 cancel-to-result within one prompt chunk + 2 steps (p99 of each, "
                             "from the results' own timings)")
    remote_phase.add_arguments(parser)
    args = parser.parse_args(argv)
    remote_phase.check_arguments(parser, args)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    report = build_report(Soak(args).run(), args)
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(dict(asdict(report), passed=report.passed), indent=1,
                                              default=str))
    (out / "soak.md").write_text(render_markdown(report))
    (out / "rss.svg").write_text(render_svg(report.samples))
    sys.stdout.write(render_markdown(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
