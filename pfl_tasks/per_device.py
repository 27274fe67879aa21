"""Regression tasks that draw each device's data from its own stream instead of splitting a pool."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np
import torch

from pfl_tasks.base import DeviceData, MetricName, PartitionSpec, Split
from pfl_tasks.models import check_int


class PerDeviceRegression:
    """The squared-error metric and a fleet where device k's data depend only on (seed, k).

    Shared by the generated regression tasks (gaussian, sine), whatever the fleet size. A
    subclass sets `n_val` and `n_test` and implements `_make_device`, usually by handing a draw
    function to `_drawn`. The partition spec is ignored entirely (split sizes are the n_*
    options), and nothing is held back from the shared update by name.
    """

    metric_name: ClassVar[MetricName] = "mse"
    personal_patterns: tuple[str, ...] = ()
    input_names: tuple[str, ...] = ("x",)
    n_val: int
    n_test: int

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Sum of squared errors over the batch."""
        return float(torch.sum((outputs - targets) ** 2).item())

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Draw every device's data from its own seed-derived stream.

        Raises:
            ValueError: If `num_devices` is not positive.
        """
        check_int("num_devices", num_devices)
        streams = np.random.SeedSequence(seed).spawn(num_devices)
        return [self._make_device(k, np.random.default_rng(s)) for k, s in enumerate(streams)]

    def _make_device(self, device_index: int, rng: np.random.Generator) -> DeviceData:
        raise NotImplementedError

    def _drawn(
        self,
        device_index: int,
        draw: Callable[[int], Split],
        n_train: int,
        truth: Mapping[str, float],
    ) -> DeviceData:
        """One device's splits, drawn in the order train, validation, test."""
        train = draw(n_train)
        val = draw(self.n_val)
        test = draw(self.n_test)
        return DeviceData(device_index, train=train, val=val, test=test, truth=truth)
