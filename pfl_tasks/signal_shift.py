"""Feature shift for signal tasks: every device sees the same classes through its own sensor.

A device's sensor is four draws, fixed for the device: a gain, an offset, a noise level and a
time warp. Its recorded signal is `gain * x(warp(t)) + offset + noise`, so the label function
is shared while the inputs are not (FedBN's setting, Li et al. 2021): a model whose input layer
or normalization is personal can undo a device's sensor, a shared one must average over all.

A device's sensor depends only on (seed, device index), never on the fleet size or on its data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

SHIFT_STREAM: Final = 0x5E45
"""Spawn key that keeps the sensor draws apart from the partition's and the split's streams."""
MAX_LOG_GAIN: Final = math.log(2.0)
MAX_OFFSET: Final = 1.0
MAX_NOISE: Final = 0.5
MAX_LOG_WARP: Final = math.log(1.5)


@dataclass(frozen=True)
class Sensor:
    """One device's transform of a clean signal (see the module docstring).

    gain: Multiplies the signal (log-uniform in [1/2, 2] at scale 1).
    offset: Added to every sample (uniform in [-1, 1]; MNIST-1D signals have unit spread).
    noise: Standard deviation of i.i.d. Gaussian noise added per sample (uniform in [0, 0.5]).
    warp: Exponent g of the time warp t -> t^g on [0, 1] (log-uniform in [2/3, 3/2]): g > 1
        stretches the start of the signal and compresses its end, g < 1 the opposite.
    """

    gain: float
    offset: float
    noise: float
    warp: float

    def apply(self, signals: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """`signals` (n, length) as this sensor records them; the noise is drawn from `rng`."""
        length = signals.shape[-1]
        positions = np.linspace(0.0, 1.0, length) ** self.warp * (length - 1)
        low = np.minimum(np.floor(positions).astype(np.int64), length - 2)
        frac = torch.from_numpy(positions - low).to(signals.dtype)
        low_t = torch.from_numpy(low)
        warped = signals[:, low_t] * (1.0 - frac) + signals[:, low_t + 1] * frac
        noise = torch.from_numpy(rng.standard_normal(signals.shape)).to(signals.dtype)
        return self.gain * warped + self.offset + self.noise * noise

    def truth(self) -> dict[str, float]:
        """The draws, for a device's `truth` record."""
        return {"gain": self.gain, "offset": self.offset, "noise": self.noise, "warp": self.warp}


def device_sensor(
    seed: int, device_index: int, scale: float = 1.0
) -> tuple[Sensor, np.random.Generator]:
    """Device `device_index`'s sensor, and the generator its noise continues from.

    `scale` widens or narrows every range (0: the identity sensor, no noise).
    """
    rng = np.random.default_rng(
        np.random.SeedSequence(seed, spawn_key=(SHIFT_STREAM, device_index))
    )
    draws = rng.uniform(-1.0, 1.0, size=3)
    sensor = Sensor(
        gain=math.exp(scale * MAX_LOG_GAIN * draws[0]),
        offset=scale * MAX_OFFSET * float(draws[1]),
        noise=scale * MAX_NOISE * float(rng.uniform()),
        warp=math.exp(scale * MAX_LOG_WARP * draws[2]),
    )
    return sensor, rng
