"""Scripted logits rows for the engine's pure tests of sampling and verification.

They are chosen distributions (a logits row we pick): no real model can be made to produce a given
p and q, and the statistical checks need exactly known ones.
"""
from __future__ import annotations

from typing import Iterable, List

import numpy as np


def one_hot_rows(tokens: Iterable[int], vocab: int = 10) -> List[np.ndarray]:
    """One logits row per token, each peaked (logit 5, others 0) at that token."""
    return [np.eye(vocab, dtype=np.float32)[t] * 5.0 for t in tokens]


def logits_of(p) -> np.ndarray:
    """The float32 logits row whose softmax is the distribution ``p``."""
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)
