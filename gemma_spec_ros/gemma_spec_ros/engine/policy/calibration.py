"""Calibration: what one target pass costs per batch size on this device, measured at load.

The cost model (policy.CostModel) decides every draft length from these figures until real passes
replace them, so they are measured, not guessed: on a CPU the cost per row is far from linear.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Sequence

from ..llama.model import LlamaModel
from .costs import CostModel
from ..drafters.base import Drafter

#: measure_costs() measures every pass size up to this one (then only K + 1; others interpolated).
CALIBRATE_ALL_UP_TO = 9


def non_decreasing(values: Sequence[float]) -> List[float]:
    """The closest non-decreasing sequence (least squares; pool adjacent violators): a pass over more
    rows never costs less, so a size measured dearer than the next is noise, and both get their mean.

    >>> non_decreasing([36.0, 48.0, 60.0, 97.0, 112.0, 100.0, 110.0])
    [36.0, 48.0, 60.0, 97.0, 106.0, 106.0, 110.0]
    """
    blocks: List[List[float]] = []  # [sum, count] of pooled runs
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def measure_costs(target: LlamaModel, drafters: Iterable[Drafter], costs: CostModel, draft_max: int,
                  sizes: Sequence[int] = (), context_len: int = 64, repeats: int = 3,
                  warmup: int = 2) -> Dict[int, float]:
    """Measure the target's pass cost per batch size on this device (seeds the cost model).

    Every size first runs ``warmup`` untimed passes: the first passes of a batch shape are slower
    than the steady state (page faults of the memory-mapped weights on a CPU; kernel selection and
    CUDA-graph capture on a GPU, where a cold V(1) came out ~3x the steady one on an H200). A V(1)
    that is too high makes every draft look profitable, and in a speculative mode plain steps are
    rare, so the estimate would not be corrected by later measurements. The draft model, if any,
    is warmed up the same way (its cost is measured while drafting).

    By default every size from 1 to K + 1 (up to 9, then K + 1): pass costs are far from linear
    in the rows. On a 2-core CPU with the embedded Q4_K_M model, 3 rows cost as much as 4 (the
    repacked Q4_K kernels take 4 columns at a time) and 5 rows jump again; interpolating 3 from
    2 and 4 made a 2-token draft look cheaper than it is.

    Sizes are timed in rounds (every size once, ``repeats`` times), each size's fastest pass kept,
    then made :func:`non_decreasing`: a burst of load on a shared host then costs one size one of
    its passes, not its figure. Timed size by size, a single burst stayed in the shape for good
    (the cost model moves a size's shape only slowly, and a size that looks dear is never drafted,
    so never measured again): a 5-row pass came out at 2.8 V(1) instead of ~2.2, and the policy
    cut the drafts of a verbatim copy to 2 tokens where 8 paid.
    """
    k_rows = draft_max + 1
    sizes = sorted(set(sizes or (*range(1, min(k_rows, CALIBRATE_ALL_UP_TO) + 1), k_rows)))
    context_len = max(1, min(context_len, target.n_ctx - max(sizes) - 1))

    def token(i: int) -> int:  # ordinary tokens of any vocabulary, past the first control ids
        return 3 + (997 + i) % max(1, target.n_vocab - 3)

    filler = [target.bos if target.bos >= 0 else token(0)] + [token(i) for i in range(context_len - 1)]
    for drafter in drafters:
        drafter.warm_up(filler, max(sizes), warmup)
    target.clear()
    target.decode(filler, [])
    batches = {n: [token(context_len + i) for i in range(n)] for n in sizes}
    for _ in range(warmup):
        for n in sizes:
            target.decode(batches[n], range(n))
            target.rollback(context_len)
    best = {n: math.inf for n in sizes}
    for _ in range(repeats):  # in rounds over the sizes: a burst of load hits one size's pass, not all
        for n in sizes:
            _, seconds = target.timed_decode(batches[n], range(n))
            target.rollback(context_len)
            best[n] = min(best[n], seconds)
    measured = dict(zip(sizes, non_decreasing([best[n] for n in sizes])))
    for n in sizes:
        costs.observe_verify(n, measured[n])
    target.clear()
    return measured
