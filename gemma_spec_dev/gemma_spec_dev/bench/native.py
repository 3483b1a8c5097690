"""llama.cpp's own tools as a reference: ``llama-lookup`` and ``llama-speculative-simple``, run on the
bench's prompts, their printed timings parsed.

Each request starts the tool afresh (model load is outside the timings the tool prints). The peak RSS
is the child's own, from ``os.wait4``. ``llama-lookup`` with ``--spec-draft-n-max 0`` drafts nothing
and is the native plain-decoding reference. A dynamic n-gram cache file per repeat lets
``llama-lookup`` learn across the requests of a repeat, as the engine's in-memory dynamic cache does.
``llama-speculative-simple`` with an n-gram ``--spec-type`` (``--native-sweep``) needs no draft model.
The binaries come from scripts/build_native_tools.sh (the llama.cpp vendored in llama-cpp-python's
sdist, so the same llama.cpp as the engine); see docs/native_tools.md.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from gemma_spec_ros.engine.config import expand_path
from .config import NATIVE_TOOLS, RunnerSpec, base_config, model_config, thread_count
from .runner import Request, RunResult

_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
#: Runs of a tool per request when its log lacks the timings (see NativeRunner.run).
_ATTEMPTS = 10
_PATTERNS: Dict[str, "re.Pattern[str]"] = {
    "encoded": re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUMBER} seconds"),
    "decoded": re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUMBER} seconds"),
    "n_drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "n_accept": re.compile(r"n_accept\s*=\s*(\d+)"),
    "eval_runs": re.compile(rf"\beval time =\s+{_NUMBER} ms /\s+(\d+) runs"),
    "prompt_eval": re.compile(rf"prompt eval time =\s+{_NUMBER} ms /\s+(\d+) tokens"),
}


def parse_native_output(log: str) -> Dict[str, float]:
    """Timings and counters from a llama-lookup / llama-speculative-simple log (stderr).

    Keys: prompt_tokens, prompt_s, n_tokens, decode_s, n_drafted, n_accept, and eval_runs (the target's
    decode passes; the *last* 'eval time' line is the target's). Missing lines raise ValueError.

    >>> log = ("encoded   12 tokens in    0.110 seconds, speed:  109.091 t/s\\n"
    ...        "decoded  129 tokens in    2.000 seconds, speed:   64.500 t/s\\n"
    ...        "n_drafted    = 90\\nn_accept     = 60\\n"
    ...        "llama_perf_context_print:        eval time =    1900.00 ms /    70 runs\\n")
    >>> parse_native_output(log)["n_tokens"], parse_native_output(log)["eval_runs"]
    (129.0, 70.0)
    """
    out: Dict[str, float] = {}
    enc = _PATTERNS["encoded"].search(log)
    dec = _PATTERNS["decoded"].search(log)
    if enc is None or dec is None:
        raise ValueError("no 'encoded ... / decoded ... tokens in ... seconds' lines in the tool's log")
    out["prompt_tokens"], out["prompt_s"] = float(enc.group(1)), float(enc.group(2))
    out["n_tokens"], out["decode_s"] = float(dec.group(1)), float(dec.group(2))
    for key in ("n_drafted", "n_accept"):
        match = _PATTERNS[key].search(log)
        out[key] = float(match.group(1)) if match else math.nan
    runs = _PATTERNS["eval_runs"].findall(log)
    out["eval_runs"] = float(runs[-1][1]) if runs else math.nan
    out["eval_ms"] = float(runs[-1][0]) if runs else math.nan
    prompt_eval = _PATTERNS["prompt_eval"].findall(log)
    out["prompt_eval_ms"] = float(prompt_eval[-1][0]) if prompt_eval else math.nan
    return out


#: Both tools print "\n\n" twice after the generated text (after the loop and after the timings).
_TRAILER = "\n\n\n\n"


def generated_text(stdout: str, prompt: str) -> str:
    """The generated text in a tool's stdout, which echoes the prompt and then the output.

    >>> generated_text("\\n\\n<bos>Q: DNS?\\nA: It maps names.\\n\\n\\n\\n", "Q: DNS?\\nA:")
    ' It maps names.'
    """
    at = stdout.find(prompt)
    text = stdout[at + len(prompt):] if at >= 0 else stdout
    return text[:-len(_TRAILER)] if text.endswith(_TRAILER) else text


class NativeRunner:
    """Runs one native tool per request; a :class:`~.runner.MeasuredRunner`, as a worker handle."""

    def __init__(self, spec: RunnerSpec, params: Mapping[str, Any], bin_dir: str, workdir: Path,
                 repeat: int, timeout_s: float = 600.0) -> None:
        target = model_config(params, "target")
        if target is None:
            raise ValueError("no target model")
        self.spec = spec
        self._exe = Path(expand_path(bin_dir)) / NATIVE_TOOLS[spec.mode]
        self._timeout_s = timeout_s
        # flash attention as our engine runs it (the tools' default, auto, turns it on here)
        self._base: List[str] = [str(self._exe), "-m", target.resolved_path, "-c", str(target.n_ctx),
                                 "-t", str(thread_count(params)), "-fa", "on" if target.flash_attn else "off"]
        # draft_max None: an n-gram --spec-type, whose own settings (native_args) bound the draft
        self._drafts = spec.draft_max != 0
        if spec.draft_max is not None:
            self._base += ["--spec-draft-n-max", str(spec.draft_max)]
        if spec.mode == "lookup":
            safe = spec.name.replace("/", "_")
            self._base += ["-lcd", str(workdir / f"{safe}-repeat{repeat}.lcd")]
            static = expand_path(str(params.get("lookup.static_path", "") or ""))
            if static and spec.draft_max:
                self._base += ["-lcs", static]
        elif spec.mode == "speculative-ngram":  # drafts from the context alone: no draft model
            self._base += list(spec.native_args)
        else:
            draft = model_config(params, "draft")
            if draft is None:
                raise ValueError("llama-speculative-simple needs a draft model")
            self._base += ["-md", draft.resolved_path]
            spec_type = {"speculative-mtp": "draft-mtp", "speculative-eagle3": "draft-eagle3"}.get(spec.mode)
            if spec_type:  # the Gemma 4 assistant or the EAGLE-3 head, at our engine's p_min
                p_min = base_config(params).spec.p_min
                self._base += ["--spec-type", spec_type, "--spec-draft-p-min", str(p_min)]
        self.peak_rss_mb = 0.0
        self.base_rss_mb: Optional[float] = None  # the tool is the whole process: no base to tell apart
        self.info: Dict[str, Any] = {"command": self._base}

    def command(self, request: Request) -> List[str]:
        """The tool's command line for one request. ``-n`` is one less than max_tokens because the
        tools stop only after generating more than ``-n`` tokens."""
        return self._base + ["--no-escape", "-p", str(request["prompt"]),
                             "-n", str(max(1, int(request["max_tokens"]) - 1)),
                             "--temp", str(float(request["temperature"])), "-s", str(int(request["seed"]))]

    def run(self, request: Request) -> RunResult:
        # llama.cpp's tools log from a thread: a run of a few milliseconds (the tests' tiny models)
        # can exit before its last lines, the timings among them, reach stderr (seen in ~1 of 10
        # runs). Such a run says nothing: run it again.
        for _ in range(_ATTEMPTS):
            stdout, log, usage = self._run_once(request)
            if _PATTERNS["decoded"].search(log):
                break
        self.peak_rss_mb = max(self.peak_rss_mb, usage.ru_maxrss / 1024.0)
        parsed = parse_native_output(log)
        n_tokens = int(parsed["n_tokens"])
        wall = parsed["prompt_s"] + parsed["decode_s"]
        drafted, accepted = parsed["n_drafted"], parsed["n_accept"]
        # The step profile. llama_perf counts a multi-token decode as "prompt eval" and a one-token
        # decode as "eval", so the verify passes' decode time is both, less the prompt's (the
        # "encoded ... in" line). The prompt's pass gives the first token, each later pass its
        # accepted tokens + 1: passes = tokens - 1 - accepted.
        accepted_tokens = accepted if self._drafts and not math.isnan(accepted) else 0.0
        verify_ms = parsed["eval_ms"] + (parsed["prompt_eval_ms"] - parsed["prompt_s"] * 1e3
                                         if not math.isnan(parsed["prompt_eval_ms"]) else 0.0)
        stats: Dict[str, Any] = {"num_steps": max(1.0, n_tokens - 1 - accepted_tokens),
                                 "decode_ms": parsed["decode_s"] * 1e3}
        # draft-eagle3's "encoded" time also covers the head's pass over the prompt, so the prompt's
        # share cannot be told apart: the verify time is then unknown (the step profile shows "-")
        if verify_ms >= 0:
            stats["verify_ms"] = verify_ms
        if self._drafts:
            stats.update({"num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                          "acceptance_rate": accepted / drafted if drafted else math.nan,
                          "tokens_per_pass": (n_tokens - 1) / stats["num_steps"]})
        # What the printed decode time covers: llama-lookup starts its clock before it samples the
        # first token from the logits of the prompt's pass (timed in "encoded"), and stops after
        # sampling the last without decoding it: n_tokens - 1 target passes, the same as our rate
        # counts after the first token. llama-speculative-simple decodes the prompt's last token
        # inside its loop: every token's pass is in its time.
        n_first = 1 if self.spec.mode == "lookup" else 0
        return RunResult(text=generated_text(stdout, str(request["prompt"])), n_tokens=n_tokens,
                         wall_s=wall, ttft_s=parsed["prompt_s"], n_first=n_first,
                         finish_reason="length" if n_tokens >= int(request["max_tokens"]) else "stop",
                         decode_s=parsed["decode_s"], stats=stats, draft_max_last=self.spec.draft_max,
                         peak_rss_mb=self.peak_rss_mb)

    def _run_once(self, request: Request) -> Tuple[str, str, Any]:
        """(stdout, stderr, rusage) of one run of the tool; RuntimeError if it fails or hangs."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(self.command(request), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
            try:
                _, status, usage = _wait4(proc, self._timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{self._exe.name} ran past {self._timeout_s:.0f} s") from None
            out.seek(0)
            err.seek(0)
            stdout = out.read().decode("utf-8", "replace")
            log = err.read().decode("utf-8", "replace")
        if status != 0:
            tail = "\n".join(log.strip().splitlines()[-5:])
            raise RuntimeError(f"{self._exe.name} exited with {status}: {tail}")
        return stdout, log, usage

    def close(self) -> None:
        """Nothing is held between requests."""


def _wait4(proc: "subprocess.Popen[bytes]", timeout_s: float) -> Tuple[int, int, Any]:
    """``os.wait4`` on the child, so the rusage (peak RSS) is that child's alone; with a timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return pid, proc.returncode, usage
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        time.sleep(0.02)


__all__ = ["NativeRunner", "generated_text", "parse_native_output"]
