"""int8 levels for secure aggregation: one step for every device, the sum in a small ring.

Under `--secagg --compress int8` each device sends its (clipped, weighted) delta as int8 levels
of a step the round fixes in advance, bound / 127 with the bound every device's value is clamped
to, so the ring sum of the levels dequantizes with that one step. Rounding is stochastic (each
level up or down with the probability that keeps it unbiased), or under DP conditional, so the
levels never pass the clip norm the accountant assumes. A sum of m levels in [-127, 127] fits
`level_bits(m)` bits: masked levels travel modulo 2^bits, bit-packed.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from protocols.discrete_gaussian import conditional_round, rounding_bound
from protocols.messages import DevicePrivacy

LEVELS: Final = 127
"""int8 levels lie in [-127, 127] (symmetric, as `protocols.compression`'s)."""
TOPK_MASKED: Final = (
    "each device's top-k keeps other positions, and masks cancel only in a sum over the same "
    "positions: use --compress none or int8"
)
"""Why top-k uplink does not compose with secure aggregation."""
ROUNDED_GAUSSIAN: Final = (
    "int8 levels would round each device's share of continuous Gaussian noise, and a sum of "
    "rounded Gaussians is no Gaussian mechanism: use --dp-distribution discrete-gaussian "
    "(counted on the levels' grid) or --compress none"
)
"""Why device-placed continuous DP noise does not compose with int8 under secure aggregation."""


def level_bits(cohort: int) -> int:
    """Bits of the smallest ring whose signed integers hold any sum of `cohort` int8 levels."""
    return (LEVELS * cohort).bit_length() + 1


def signed_levels(words: np.ndarray, bits: int) -> np.ndarray:
    """Words of Z_(2^32) read modulo 2^bits as signed `bits`-bit integers."""
    low = words.astype(np.int64) & ((1 << bits) - 1)
    out: np.ndarray = np.where(low >= 1 << (bits - 1), low - (1 << bits), low)
    return out


def pack_levels(words: np.ndarray, bits: int) -> np.ndarray:
    """The low `bits` bits of each word, bit-packed little-endian: ceil(n * bits / 8) bytes."""
    shifts = np.arange(bits, dtype=np.uint32)
    planes = ((words.astype(np.uint32)[:, None] >> shifts) & 1).astype(np.uint8)
    packed: np.ndarray = np.packbits(planes.reshape(-1), bitorder="little")
    return packed


def unpack_levels(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    """`pack_levels` undone: `count` words in [0, 2^bits).

    Raises:
        ValueError: not the bytes `count` words of `bits` bits pack to, or padding bits set.
    """
    if packed.size != packed_size(count, bits):
        msg = f"{packed.size} packed bytes, {packed_size(count, bits)} expected"
        raise ValueError(msg)
    planes = np.unpackbits(packed.astype(np.uint8), bitorder="little")
    if planes[count * bits :].any():
        msg = "packed levels with padding bits set"
        raise ValueError(msg)
    weights = np.left_shift(np.uint32(1), np.arange(bits, dtype=np.uint32))
    words: np.ndarray = planes[: count * bits].reshape(count, bits).astype(np.uint32) @ weights
    return words.astype(np.uint32)


def packed_size(count: int, bits: int) -> int:
    """Bytes `count` words of `bits` bits pack to."""
    return (count * bits + 7) // 8


def int8_levels(
    values: np.ndarray, bound: float, clip: float | None, rng: np.random.Generator
) -> np.ndarray:
    """Each value (clamped to +-bound) as int8 levels of step bound / 127, rounded unbiased.

    With `clip` (under DP the L2 norm the accountant's sensitivity assumes) the levels keep
    it: the values are first shrunk so that conditional rounding (Kairouz et al. 2021, as in
    `protocols.discrete_gaussian`) passes with probability 1 - beta, then rounded again until
    the levels' norm is within clip. The shrink is a small, deterministic bias: the price of a
    sensitivity that rounding does not raise.

    Raises:
        ValueError: the levels cannot keep `clip` at this dimension (d / 4 alone passes it).
    """
    scale = LEVELS / bound
    scaled = np.clip(np.nan_to_num(values.astype(np.float64)), -bound, bound) * scale
    if clip is None:
        floor = np.floor(scaled)
        levels = floor + (rng.random(scaled.shape) < scaled - floor)
        out: np.ndarray = np.clip(levels, -LEVELS, LEVELS).astype(np.int64)
        return out
    limit = clip * scale
    if rounding_bound(0.0, scaled.size) > limit:
        msg = (
            f"int8 levels of step {bound / LEVELS:.3g} cannot keep DP's clip norm {clip:g} over "
            f"{scaled.size} coordinates (rounding alone may add sqrt(d)/2 levels): use "
            "--compress none"
        )
        raise ValueError(msg)
    low, high = 0.0, float(np.linalg.norm(scaled))
    if rounding_bound(high, scaled.size) > limit:
        for _ in range(60):  # the largest norm whose rounding bound stays within the clip
            middle = (low + high) / 2
            low, high = (
                (middle, high) if rounding_bound(middle, scaled.size) <= limit else (low, middle)
            )
        scaled = scaled * (low / float(np.linalg.norm(scaled)))
    return conditional_round(scaled, limit, rng)


def levels_problem(privacy: DevicePrivacy | None) -> str:
    """Why a round's DP cannot sum int8 levels ("" when it can).

    Coordinator-placed noise is added to the decoded sum, each device's levels kept within the
    clip norm (`int8_levels`); the discrete Gaussian is drawn on the levels' grid and counted
    there. Continuous noise a device adds itself would be rounded to levels with the delta.
    """
    if privacy is None or privacy.discrete or privacy.noise_std == 0:
        return ""
    return ROUNDED_GAUSSIAN
