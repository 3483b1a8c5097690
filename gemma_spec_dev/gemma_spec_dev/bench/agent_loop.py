"""The agent loop, measured: the agent suite's conversations (:mod:`.agent_suite`) as chat turns.

    python -m gemma_spec_dev.bench.agent_loop --out docs/bench/cpu_agent_loop

Runners (each plays every task of the suite; the tasks' turns are interleaved, task 1's turn 1, task
2's turn 1, ..., as several planners sharing the node; each (task, turn) step runs every runner once,
in a rotating order):

- ``<mode>`` for each mode of ``--modes``: an Engine of its own (the embedded model, the suite's
  template as chat.template_path, the shipped profiles' settings: adaptive K, prompt reuse,
  conversation snapshots, the grammar tokenizer built at load), so that its learned caches and
  snapshots hold its own turns only, as a node serving these planners would;
- ``<mode>/no-reuse`` for each mode of ``--no-reuse-modes``: the same with prompt reuse off, every
  turn's prompt evaluated whole (the reference of the conversation-reuse figure);
- ``<mode>/auto`` for each mode of ``--auto-modes``: the call turns with ``tool_choice`` auto and one
  call allowed (LangChain's ``bind_tools`` default) instead of required: such a turn must end where
  its call closes, as a required one does (its turn time against ``<mode>``'s, per call turn);
- ``llama-server/<spec-type>`` for each of ``--server-settings``: llama.cpp's server on the same
  model and template (``--jinja --chat-template-file``), ``/v1/chat/completions`` with the same
  tools and ``tool_choice``, through the node's remote backend (whose calls are validated as the
  local engine's are).

Per turn: whether the reply is what the turn asked (a turn with ``tool_choice`` required: at least
one call, every call parsed and valid against its tool's schema; the last turn: text), its time to
first token (prompt pass + first token; the server's: to its first streamed delta), its decode
tokens/s (tokens after the first / time after the first, every runner alike), tau, and its turn
time (the request sent to the reply back, wall clock: what a planner waits for). Speed is compared
on turn time: llama-server streams a call's fragments only once its parser has read the call's
name, so its "time after the first" misses the first tokens of a call turn and its tokens/s reads
high there. Writes
``agent_loop.json`` and ``agent_loop.md``. Speed figures are same-run ratios per (task, turn).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from gemma_spec_ros.engine.chat import conversation_from_json
from gemma_spec_ros.engine.config import ChatConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.remote import RemoteConfig, RemoteEngine
from gemma_spec_ros.engine.request import GenerationRequest, Step
from .agent_suite import SKILLS, TASKS, TEMPLATE, TURNS, World, schedule, task_messages, turn_choice
from .constrained import LlamaServer, by_runner

#: The engine's modes run by default (the embedded model has no draft model: the modes without one).
MODES = ("off", "lookup", "suffix", "suffix+lookup", "auto")
#: Modes also run with prompt reuse off.
NO_REUSE_MODES = ("off", "suffix")
#: Modes also run with the call turns' tool_choice auto.
AUTO_MODES = ("off",)
#: What the conversation says after a turn that had to call a skill and did not (a server may let
#: the model write text first): the conversation goes on in turns that alternate.
NUDGE = "Call one of the skills now."
#: What the report says of a run whose conversations open with the example task (--few-shot).
FEW_SHOT_NOTE = "; each conversation opens with an example task done by calls (agent_suite.EXAMPLE)"
#: llama-server's speculative settings tried (``--spec-type``, each with its defaults).
SERVER_SETTINGS = ("none", "ngram-cache", "ngram-simple", "ngram-map-k", "ngram-mod")
#: Host memory for each engine's conversation snapshots (the suite's four conversations fit).
SNAPSHOT_BYTES = 512 << 20


@dataclass
class Player:
    """One runner's side of the suite: its engine, and each task's conversation and world."""

    name: str
    engine: Any
    mode: Optional[str]  # None: the server decides
    reuse: bool
    call_choice: str = "required"  # the call turns' tool_choice (auto: one call allowed, not forced)
    conversations: List[List[Dict[str, Any]]] = field(default_factory=list)
    worlds: List[World] = field(default_factory=list)

    def turn(self, task: int, turn: int, max_tokens: int, text_tokens: int) -> Dict[str, Any]:
        """Play one turn: the request, its steps, the reply checked; the conversation goes on."""
        choice = turn_choice(turn)
        choice = self.call_choice if choice == "required" else choice
        conversation = conversation_from_json({"messages": self.conversations[task], "tools": SKILLS,
                                               "tool_choice": choice})
        request = GenerationRequest(conversation=conversation, sampling=SamplingParams(temperature=0.0),
                                    max_tokens=max_tokens if choice != "none" else text_tokens,
                                    spec_mode=self.mode, reuse_prompt=self.reuse)
        last: Optional[Step] = None
        started = time.perf_counter()
        for last in self.engine.generate(request):
            pass
        turn_ms = (time.perf_counter() - started) * 1e3
        assert last is not None and last.reply is not None, f"{self.name}: the turn gave no reply"
        reply = last.reply
        problem = reply.error or ("" if choice == "none" or reply.tool_calls else "no tool call")
        if choice == "none" and reply.tool_calls:
            problem = "a call in a text turn"
        self._go_on(task, reply, choice)
        stats = last.stats
        return {"runner": self.name, "task": task, "turn": turn, "tool_choice": choice,
                "finish_reason": reply.finish_reason(last.finish_reason or "length"), "problem": problem,
                "calls": [c.name for c in reply.tool_calls], "calls_left_out": _left_out(reply.error),
                "prompt_tokens": stats.num_prompt_tokens,
                "reused_tokens": stats.num_prompt_tokens_reused, "tokens": stats.num_generated_tokens,
                "ttft_ms": stats.time_to_first_token * 1e3, "tokens_per_s": stats.tokens_per_second,
                "tau": stats.mean_acceptance_length, "spec_mode": last.spec_mode, "turn_ms": turn_ms}

    def _go_on(self, task: int, reply: Any, choice: str) -> None:
        """The reply and each call's result (from the task's world) join the conversation; a turn
        that should have called a skill and did not is followed by :data:`NUDGE`."""
        messages = self.conversations[task]
        message: Dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in reply.tool_calls]
        messages.append(message)
        for call in reply.tool_calls:
            result = self.worlds[task].run(call.name, json.loads(call.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if choice != "none" and not reply.tool_calls:
            messages.append({"role": "user", "content": NUDGE})


def _left_out(error: str) -> int:
    """Calls a reply's ``error`` says were left out (did not parse, not offered, failed the schema,
    cut by max_tokens); a turn that called nothing is not one."""
    reasons = [e for e in error.split("; ") if e and not e.startswith("tool_choice ")]
    return len(reasons)


def summarize(records: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    out = {}
    for runner, rows in by_runner(records).items():
        follow = [r for r in rows if r["turn"] > 0]
        call_turns = [r for r in rows if r["tool_choice"] != "none"]
        calls = sum(len(r["calls"]) for r in rows)
        left_out = sum(r["calls_left_out"] for r in rows)
        out[runner] = {
            "turns": len(rows), "valid_share": sum(not r["problem"] for r in rows) / len(rows),
            "call_turns": len(call_turns), "call_turns_with_calls": sum(bool(r["calls"]) for r in call_turns),
            "calls_valid": calls, "calls_left_out": left_out,
            "tokens_per_s_median": _median(r["tokens_per_s"] for r in rows),
            "turn_ms_median": _median(r["turn_ms"] for r in rows),
            "ttft_ms_first_median": _median(r["ttft_ms"] for r in rows if r["turn"] == 0),
            "ttft_ms_follow_median": _median(r["ttft_ms"] for r in follow),
            "reused_share_follow": (sum(r["reused_tokens"] for r in follow)
                                    / max(1, sum(r["prompt_tokens"] for r in follow))),
            "tau_median": _median(r["tau"] for r in rows), "tokens_mean": statistics.mean(r["tokens"] for r in rows),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows),
        }
    return out


def _median(values: Any) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v) and v > 0]
    return statistics.median(kept) if kept else math.nan


def ratios(records: Sequence[Mapping[str, Any]], runner: str, reference: str, key: str,
           follow_only: bool = False) -> List[float]:
    """Per-(task, turn) ratios of ``key``, runner / reference (follow-up turns only if asked)."""
    value = {(r["task"], r["turn"], r["runner"]): r[key] for r in records}
    out = []
    for (task, turn, name), mine in value.items():
        theirs = value.get((task, turn, reference))
        if name != runner or (follow_only and turn == 0) or not theirs or not mine:
            continue
        if not (math.isnan(mine) or math.isnan(theirs)):
            out.append(mine / theirs)
    return out


def _ratio_text(values: List[float]) -> str:
    return f"{statistics.median(values):.2f}x" if values else "-"


def _rate_text(runner: str, summary: Mapping[str, Any]) -> str:
    """The median decode rate; none for llama-server, whose call fragments stream in bursts once
    its parser has read a call (see the module docstring)."""
    return "-" if runner.startswith("llama-server/") else f"{summary['tokens_per_s_median']:.1f}"


def markdown(results: Mapping[str, Any]) -> str:
    summary, records = results["summary"], results["records"]
    lines = [f"# Agent loop: {results['tasks']} tasks x {results['turns']} turns, the robot's skills as tools",
             "", f"Model {results['model']} with the agent suite's chat template given explicitly (the "
             f"model has none){FEW_SHOT_NOTE if results.get('few_shot') else ''}; "
             f"greedy; max_tokens {results['max_tokens']} per call turn, "
             f"{results['text_tokens']} for the closing text turn; {results['threads']} threads. Same run, "
             "turns interleaved across tasks and runners. Tokens/s: decode rate after the first token; "
             "TTFT: prompt pass + first token (llama-server's: its first streamed delta); tokens/s not "
             "shown for llama-server (a call's fragments stream in a burst once its parser has read the "
             "call: rates of thousands of tokens/s); turn: the request to the reply, wall clock; speedup: "
             "off's turn time / the runner's, per (task, turn), median.", "",
             "| runner | turns as asked | call turns with a call | calls valid / returned | turn ms (median) | "
             "speedup vs off | tokens/s (median) | TTFT first turn ms | TTFT follow-up ms | "
             "follow-up TTFT vs no reuse | prompt reused (follow-ups) | tau |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for runner, s in summary.items():
        base = runner.split("/")[0]
        no_reuse = f"{base}/no-reuse"
        paired = no_reuse in summary and runner != no_reuse
        vs_reuse = ratios(records, runner, no_reuse, "ttft_ms", True) if paired else []
        returned = s["calls_valid"] + s["calls_left_out"]
        lines.append(
            f"| {runner} | {100 * s['valid_share']:.0f}% | {s['call_turns_with_calls']}/{s['call_turns']} | "
            f"{s['calls_valid']}/{returned} | {s['turn_ms_median']:.0f} | "
            f"{_ratio_text(ratios(records, 'off', runner, 'turn_ms'))} | {_rate_text(runner, s)} | "
            f"{s['ttft_ms_first_median']:.0f} | "
            f"{s['ttft_ms_follow_median']:.0f} | {_ratio_text(vs_reuse)} | {100 * s['reused_share_follow']:.0f}% | "
            f"{s['tau_median']:.2f} |")
    for runner in summary:
        if runner.endswith("/auto") and runner[:-len("/auto")] in summary:
            base = runner[:-len("/auto")]
            calls = [r for r in records if r["tool_choice"] != "none"]
            lines += ["", f"Call turns with `tool_choice` auto (one call allowed) against required, {base}: "
                      f"turn time {_ratio_text(ratios(calls, runner, base, 'turn_ms'))}, tokens "
                      f"{_ratio_text(ratios(calls, runner, base, 'tokens'))} (median per call turn); "
                      f"finish reasons {_count(r['finish_reason'] for r in calls if r['runner'] == runner)}."]
    best = results.get("best_server")
    if best:
        lines += ["", f"Best llama-server setting (shortest median turn): `{best}`. Its turn time / ours, "
                  "per turn (median): " + ", ".join(f"{m} {_ratio_text(ratios(records, best, m, 'turn_ms'))}"
                                                    for m in results["modes"])]
    bad = [r for r in records if r["problem"]]
    if bad:
        lines += ["", "Turns whose reply was not what the turn asked:"] + [
            f"- {r['runner']} task {r['task']} turn {r['turn']}: {r['problem'][:160]}" for r in bad]
    return "\n".join(lines) + "\n"


def _count(values: Any) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-reuse-modes", default=",".join(NO_REUSE_MODES))
    p.add_argument("--auto-modes", default=",".join(AUTO_MODES),
                   help="modes also run with the call turns' tool_choice auto (one call allowed)")
    p.add_argument("--server-settings", default=",".join(SERVER_SETTINGS),
                   help="llama-server --spec-type values to run ('' = none)")
    p.add_argument("--few-shot", action="store_true",
                   help="every conversation starts with an example task done by calls (agent_suite.EXAMPLE): "
                        "a base model then calls under tool_choice auto too")
    p.add_argument("--tasks", type=int, default=len(TASKS))
    p.add_argument("--turns", type=int, default=TURNS)
    p.add_argument("--max-tokens", type=int, default=64, help="per call turn")
    p.add_argument("--text-tokens", type=int, default=32, help="for the closing text turn")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--native-bin", default=os.path.expanduser("~/.cache/gemma_spec_ros/native/bin"))
    p.add_argument("--out", default="bench_agent_loop")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    template = Path(tempfile.mkdtemp(prefix="agent-loop-")) / "agent_suite.jinja"
    template.write_text(TEMPLATE)

    players: List[Player] = []
    servers: List[LlamaServer] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed run stops its servers
    try:
        players += [local_player(m, True, args, template) for m in modes]
        players += [local_player(m, False, args, template) for m in args.no_reuse_modes.split(",") if m]
        players += [local_player(m, True, args, template, "auto") for m in args.auto_modes.split(",") if m]
        for setting in filter(None, args.server_settings.split(",")):
            server = LlamaServer(Path(args.native_bin) / "llama-server", args.model, args.n_ctx, args.threads,
                                 setting, out, ["--jinja", "--chat-template-file", str(template)])
            servers.append(server)
            players.append(Player(f"llama-server/{setting}", RemoteEngine(
                RemoteConfig(url=server.url, probe_period=0), SpecConfig()), None, True))
        for player in players:
            player.conversations = [task_messages(task, args.few_shot) for task in TASKS[:args.tasks]]
            player.worlds = [World() for _ in player.conversations]
        records = play(players, args)
    finally:
        for player in players:
            player.engine.close()
        for server in servers:
            server.stop()
        signal.signal(signal.SIGTERM, previous)
    summary = summarize(records)
    server_names = [n for n in summary if n.startswith("llama-server/")]
    best = min(server_names, key=lambda n: summary[n]["turn_ms_median"], default=None)
    results = {"tasks": args.tasks, "turns": args.turns, "few_shot": args.few_shot, "max_tokens": args.max_tokens,
               "text_tokens": args.text_tokens, "threads": args.threads, "model": Path(args.model).name,
               "modes": modes, "summary": summary, "best_server": best, "records": records}
    (out / "agent_loop.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "agent_loop.md").write_text(markdown(results))
    print(markdown(results))
    return 0


def local_player(mode: str, reuse: bool, args: argparse.Namespace, template: Path,
                 call_choice: str = "required") -> Player:
    """A runner on an Engine of its own (see the module docstring)."""
    config = EngineConfig(target=ModelConfig(args.model, n_ctx=args.n_ctx, n_threads=args.threads),
                          spec=SpecConfig(mode=mode), prepare_grammar=True,  # as the shipped profiles
                          chat=ChatConfig(template_path=str(template), conversation_cache_bytes=SNAPSHOT_BYTES))
    name = f"{mode}/auto" if call_choice == "auto" else mode if reuse else f"{mode}/no-reuse"
    return Player(name, Engine(config), mode, reuse, call_choice)


def play(players: Sequence[Player], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every (task, turn) of the schedule, each by every player in a rotating order."""
    records: List[Dict[str, Any]] = []
    for i, (task, turn) in enumerate(schedule(args.tasks, args.turns)):
        order = list(players[i % len(players):]) + list(players[:i % len(players)])
        for player in order:
            record = player.turn(task, turn, args.max_tokens, args.text_tokens)
            records.append(record)
            print(f"task {task} turn {turn} {player.name:<26} {record['tokens_per_s']:7.1f} tok/s "
                  f"TTFT {record['ttft_ms']:7.0f} ms {record['tokens']:3d} tokens {record['calls']} "
                  f"{record['problem'][:60]}", file=sys.stderr)
    return records


if __name__ == "__main__":
    sys.exit(main())
