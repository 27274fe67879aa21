"""Which devices take part in a round: uniform sampling without replacement."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def select_devices(
    candidates: Sequence[str], fraction: float, rng: np.random.Generator, minimum: int = 1
) -> tuple[str, ...]:
    """A sorted sample of ceil(fraction * n) candidates (at least `minimum`, at most n).

    Raises:
        ValueError: `fraction` is outside (0, 1].
    """
    if not 0 < fraction <= 1:
        msg = f"participation must be in (0, 1], got {fraction}"
        raise ValueError(msg)
    pool = sorted(candidates)
    count = min(len(pool), max(minimum, math.ceil(fraction * len(pool) - 1e-9)))
    if count >= len(pool):
        return tuple(pool)
    chosen = rng.choice(len(pool), size=count, replace=False)
    return tuple(sorted(pool[index] for index in chosen))
