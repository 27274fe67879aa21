"""Which devices take part in a round: uniform sampling without replacement, or Poisson."""

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


def poisson_sample(
    candidates: Sequence[str], rate: float, rng: np.random.Generator
) -> tuple[str, ...]:
    """Each candidate kept independently with probability `rate` (in the order given).

    The sample may be empty (probability (1 - rate)^n): drawing again would change the
    sampling distribution the accountant assumes, so an empty sample is a round too.
    """
    draws = rng.random(len(candidates))
    return tuple(c for c, u in zip(candidates, draws, strict=True) if u < rate)
