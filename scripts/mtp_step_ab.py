"""Our MTP (or EAGLE-3) step against llama.cpp's, interleaved in one loop: the engine in this process
(no bench worker), then ``llama-speculative-simple --spec-type draft-mtp`` (``draft-eagle3`` when
the draft file is an EAGLE-3 head) on the same pair, prompt and K, ROUNDS times; medians of
milliseconds per target pass after the first token (docs/benchmarks.md).

    .venv/bin/python scripts/mtp_step_ab.py TARGET.gguf ASSISTANT_OR_HEAD.gguf [ROUNDS]

The tiny pairs of the tests: ``write_gemma4_pair(dir, agreeing=...)`` in test/support/tiny_gemma4.py,
``write_eagle3_pair(dir, agreeing=...)`` in test/support/tiny_eagle3.py.
Each request generates MTP_AB_TOKENS tokens (default 1500; n_ctx is that + 64). Runs of 200 tokens
last ~25 ms on the tiny pair, and this shared host's noise comes in bursts about that long: their
medians scattered from 0.87x to 1.28x between calls, those of 1500-token runs from 0.92x to 1.09x.
Besides the ratio of the medians it prints the quartiles of each round's ratio (ours / llama.cpp,
the two runs back to back), which a change of the host's load between rounds moves less.
MTP_AB_DRAFT_FA=0 runs our draft (assistant or head) without flash attention (llama.cpp's tool has
no setting of its own for the draft's: it uses the target's, auto = on here).
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from typing import List

from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SpecConfig
from gemma_spec_ros.engine.drafters.eagle3 import is_eagle3_head
from gemma_spec_ros.engine.request import GenerationRequest

TOOL = os.path.expanduser("~/.cache/gemma_spec_ros/native/bin/llama-speculative-simple")
PROMPT, K, P_MIN = "the robot picks up the red cup. ", 3, 0.75
MAX_TOKENS = int(os.environ.get("MTP_AB_TOKENS", "1500"))
N_CTX = MAX_TOKENS + 64
#: the draft's flash attention (MTP_AB_DRAFT_FA=0: off); the node gives it the target's (on)
DRAFT_FLASH_ATTN = os.environ.get("MTP_AB_DRAFT_FA", "1") != "0"


def native_step_ms(target: str, assistant: str, mode: str) -> float:
    """decode time / target passes of one run; the tool logs from a thread and can exit before
    its last lines are out: such a run is repeated."""
    argv = [TOOL, "-m", target, "-md", assistant, "--spec-type", f"draft-{mode}", "--spec-draft-n-max", str(K),
            "--spec-draft-p-min", str(P_MIN), "-c", str(N_CTX), "-t", "1", "-p", PROMPT,
            "-n", str(MAX_TOKENS - 1), "--temp", "0", "--no-escape"]
    for _ in range(10):
        log = subprocess.run(argv, capture_output=True, text=True, check=True).stderr
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", log)
        accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
        if decoded and accepted:
            passes = int(decoded.group(1)) - 1 - int(accepted.group(1))
            return float(decoded.group(2)) / passes * 1e3
    raise RuntimeError("llama-speculative-simple printed no timings in 10 runs")


def quartiles(values: List[float]) -> str:
    """'median (q1-q3, min-max)' of ``values``."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{median:.3f} ({q1:.3f}-{q3:.3f}, {min(values):.3f}-{max(values):.3f})"


def main() -> None:
    target, assistant = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    mode = "eagle3" if is_eagle3_head(assistant) else "mtp"
    engine = Engine(EngineConfig(
        target=ModelConfig(target, n_ctx=N_CTX, n_threads=1, flash_attn=True),  # llama.cpp: auto
        draft=ModelConfig(assistant, n_ctx=N_CTX, n_threads=1, flash_attn=DRAFT_FLASH_ATTN),
        spec=SpecConfig(mode=mode, draft_max=K, p_min=P_MIN, adaptive=False)))
    ours: List[float] = []
    native: List[float] = []
    try:
        for _ in range(rounds):
            stats = list(engine.generate(GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)))[-1].stats
            ours.append(stats.generation_time / stats.num_steps * 1e3)
            native.append(native_step_ms(target, assistant, mode))
    finally:
        engine.close()
    paired = [a / b for a, b in zip(ours, native)]  # each round's two runs back to back
    print(f"{mode}, {rounds} rounds, the draft's flash attention {'on' if DRAFT_FLASH_ATTN else 'off'}; "
          f"ms per target pass, median (quartiles, range): ours {quartiles(ours)}, llama.cpp "
          f"{quartiles(native)}; ratio of medians {statistics.median(ours) / statistics.median(native):.3f}, "
          f"per-round ratios {quartiles(paired)}; acceptance {stats.acceptance_rate:.2f}, "
          f"{stats.num_steps} passes")


if __name__ == "__main__":
    main()
