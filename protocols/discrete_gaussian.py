"""The distributed discrete Gaussian: noise added by devices inside secure aggregation's ring.

Kairouz, Liu and Steinke 2021, "The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation". Continuous Gaussian noise rounded to a fixed-point grid is
not the Gaussian mechanism any more (its privacy analysis does not survive the rounding and the
clamp), so under `--dp-distribution discrete-gaussian` each device works in the ring's integers:

1. its clipped delta x (||x||_2 <= C) is scaled by the ring's fixed-point scale g (the delta
   group's scale, `protocols.secure_aggregation.group_scale`);
2. g x is rounded to integers by conditional randomized rounding: each coordinate up or down
   with the probability that keeps it unbiased, drawn again until the rounded vector's norm is
   within `rounding_bound` (the paper's Proposition 22, with beta = exp(-1/2): each draw passes
   with probability at least 1 - beta, about 0.39);
3. it adds discrete Gaussian noise N_Z(0, (g s)^2) per coordinate, s = z C / sqrt(m) its share,
   sampled by Canonne, Kamath and Steinke 2020's rejection sampler (Algorithm 3: a discrete
   Laplace proposal, accepted with a Gaussian ratio), its probabilities in float64 rather than
   their exact rational arithmetic (the draws are integers; the probabilities carry float64
   rounding);
4. the integers are masked and summed modulo 2^32 (no clamp: the sum modulo 2^32 is a function
   of the noised sum, so wrap-around costs accuracy, never privacy).

No random rotation is applied: the norm bound after rounding is the paper's bound without
flattening, (g C + sqrt(d))^2 or g^2 C^2 + d/4 + sqrt(2 ln(1/beta)) (g C + sqrt(d)/2), whichever
is smaller: about g C + 1/2 + d / (8 g C). A 32-bit ring's grid makes that small: for a cohort
of 10^4 at Z = 1, g C is about 2 10^5 and d = 10^6 adds under 1e-5 of it. The accounting of
the sum is `coordinator.stages.discrete_accountant`.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

BETA: Final = math.exp(-0.5)
"""Conditional rounding's failure bound per draw (the paper's choice)."""
MAX_ROUNDINGS: Final = 1000
"""Draws before giving up (each fails with probability at most beta: 0.61^1000 ~ 1e-215)."""


def rounding_bound(scaled_clip: float, dimension: int, beta: float = BETA) -> float:
    """The L2 norm a conditionally rounded vector keeps, in ring units (the sensitivity).

    `scaled_clip` is g C, the clip norm on the ring's grid; `dimension` the coordinates rounded.
    """
    plain = (scaled_clip + math.sqrt(dimension)) ** 2
    tail = math.sqrt(2 * math.log(1 / beta)) if beta > 0 else math.inf
    conditioned = scaled_clip**2 + dimension / 4 + tail * (scaled_clip + math.sqrt(dimension) / 2)
    return math.sqrt(min(plain, conditioned))


def conditional_round(
    values: np.ndarray, bound: float, rng: np.random.Generator, beta: float = BETA
) -> np.ndarray:
    """Unbiased randomized rounding to integers, drawn again until its norm is within `bound`.

    Raises:
        ValueError: `MAX_ROUNDINGS` draws all above the bound (`values` are not within the clip
            the bound was computed for).
    """
    floor = np.floor(values)
    up = values - floor
    for _ in range(MAX_ROUNDINGS):
        rounded = floor + (rng.random(values.shape) < up)
        if float(np.linalg.norm(rounded)) <= bound:
            out: np.ndarray = rounded.astype(np.int64)
            return out
    msg = f"no rounding within the norm bound {bound:.6g} in {MAX_ROUNDINGS} draws"
    raise ValueError(msg)


def discrete_laplace(scale: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` draws of the discrete Laplace P(y) ~ exp(-|y| / scale) on the integers.

    The difference of two geometric variables of ratio exp(-1/scale).
    """
    success = -math.expm1(-1 / scale)
    first = rng.geometric(success, size).astype(np.int64)
    second = rng.geometric(success, size).astype(np.int64)
    out: np.ndarray = first - second
    return out


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` draws of N_Z(0, sigma^2): P(y) ~ exp(-y^2 / (2 sigma^2)) on the integers.

    Canonne, Kamath and Steinke 2020, Algorithm 3: a discrete Laplace draw Y of scale
    t = floor(sigma) + 1 is kept with probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)),
    vectorised: the rejected coordinates are drawn again until none is left.
    """
    if sigma <= 0:
        return np.zeros(size, dtype=np.int64)
    t = math.floor(sigma) + 1
    out = np.zeros(size, dtype=np.int64)
    pending = np.arange(size)
    while pending.size:
        proposal = discrete_laplace(t, pending.size, rng)
        gap = np.abs(proposal) - sigma * sigma / t
        keep = rng.random(pending.size) < np.exp(-(gap * gap) / (2 * sigma * sigma))
        out[pending[keep]] = proposal[keep]
        pending = pending[~keep]
    return out


def noised_ring_values(
    clipped: np.ndarray, clip_norm: float, scale: float, noise_std: float, rng: np.random.Generator
) -> np.ndarray:
    """A device's delta in the ring's integers: scaled, rounded within the bound, noised.

    `clipped` has L2 norm at most `clip_norm`; `scale` is the ring's fixed-point scale;
    `noise_std` is this device's share of the noise in the delta's own units.
    """
    bound = rounding_bound(clip_norm * scale, clipped.size)
    rounded = conditional_round(clipped * scale, bound, rng)
    noised: np.ndarray = rounded + discrete_gaussian(noise_std * scale, clipped.size, rng)
    return noised
