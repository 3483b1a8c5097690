"""Reference maths the tests check the engine against (numpy only, no engine code)."""
from __future__ import annotations

import numpy as np


def softmax(logits) -> np.ndarray:
    """Probabilities of a logits row (or of each row of a matrix), in float64.

    Shifted by the row's maximum so large logits do not overflow; float64 so a distribution
    compared with the engine's is not limited by float32 rounding of the reference itself.
    """
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(shifted - shifted.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)
