"""The sine task: FedeRiCo's noisy sine pieces, where one shared line fits no device."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import ClassVar, Final

import numpy as np
import torch
from torch import nn

from pfl_tasks.base import DeviceData, Split
from pfl_tasks.models import build_seeded, check_int, check_real
from pfl_tasks.per_device import PerDeviceRegression

INIT_STD: Final = 0.1


def _make_line() -> nn.Sequential:
    line = nn.Sequential(OrderedDict(output=nn.Linear(1, 1)))
    for parameter in line.parameters():
        nn.init.normal_(parameter, mean=0.0, std=INIT_STD)
    return line


class SineTask(PerDeviceRegression):
    """Noisy sine-curve regression with a linear model (federico.md 5.1, generator table).

    [-pi, pi] is cut into `intervals` equal contiguous pieces; device k draws x ~ U(piece k mod D)
    and y = sin x + N(0, noise_std^2). A line fits one piece well and the whole curve badly, so
    devices gain only from collaborators on the same piece.

    The loss is the mean squared error; the spec's FedeRiCo sums it over a device's training
    points, which an algorithm gets by scaling with the sample count. personal_patterns is empty:
    FedeRiCo keeps a whole model per device rather than personalizing part of a shared one.
    Data are generated per device, so the partition spec is ignored entirely (split sizes are the
    n_* options), and device k's data depend only on (seed, k). Each device's truth records its
    piece ("interval") and the piece's bounds ("interval_low", "interval_high").

    Args:
        intervals: Number of pieces D of [-pi, pi].
        n_train: Train points per device.
        n_test: Test points per device.
        n_val: Validation points per device (0 allowed).
        noise_std: Standard deviation of the label noise.
    """

    name: ClassVar[str] = "sine"
    output_names: tuple[str, ...] = ("y",)

    def __init__(
        self,
        intervals: int = 4,
        n_train: int = 20,
        n_test: int = 100,
        n_val: int = 10,
        noise_std: float = 0.1,
    ) -> None:
        self.intervals = check_int("intervals", intervals)
        self.n_train = check_int("n_train", n_train)
        self.n_test = check_int("n_test", n_test)
        self.n_val = check_int("n_val", n_val, minimum=0)
        self.noise_std = check_real("noise_std", noise_std)

    def build_model(self, seed: int) -> nn.Module:
        """A line h(x) = a x + b with a, b ~ N(0, 0.1^2), depending only on `seed`."""
        return build_seeded(seed, _make_line)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean squared error over the batch."""
        return torch.mean((outputs - targets) ** 2)

    def interval_bounds(self, interval: int) -> tuple[float, float]:
        """The [low, high) range of one piece of [-pi, pi]."""
        width = 2.0 * math.pi / self.intervals
        return -math.pi + interval * width, -math.pi + (interval + 1) * width

    def _make_device(self, device_index: int, rng: np.random.Generator) -> DeviceData:
        interval = device_index % self.intervals
        low, high = self.interval_bounds(interval)

        def draw(count: int) -> Split:
            x = rng.uniform(low, high, size=(count, 1))
            y = np.sin(x) + rng.normal(0.0, self.noise_std, size=(count, 1))
            return Split(
                torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))
            )

        truth = {"interval": interval, "interval_low": low, "interval_high": high}
        return self._drawn(device_index, draw, self.n_train, truth)
