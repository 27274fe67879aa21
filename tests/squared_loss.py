"""Mean squared error as a whole `Task`, for tests that build their own models and data."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pfl_tasks.base import DeviceData, MetricName, PartitionSpec


class SquaredLoss:
    """The loss and metric of a regression; training code asks a task for nothing else.

    The tests that use it build their models and splits themselves, so `build_model` and
    `make_fleet` say so instead of inventing a model or a fleet.
    """

    name: ClassVar[str] = "squared-loss"
    metric_name: ClassVar[MetricName] = "mse"
    personal_patterns: tuple[str, ...] = ()
    input_names: tuple[str, ...] = ("inputs",)
    output_names: tuple[str, ...] = ("outputs",)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean squared error over the batch."""
        return ((outputs - targets) ** 2).mean()

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Squared error summed over the batch."""
        return float(((outputs - targets) ** 2).sum())

    def build_model(self, seed: int) -> nn.Module:
        """Not used: each test builds its own model."""
        msg = "a SquaredLoss test builds its own model"
        raise NotImplementedError(msg)

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Not used: each test builds its own data."""
        msg = "a SquaredLoss test builds its own data"
        raise NotImplementedError(msg)
