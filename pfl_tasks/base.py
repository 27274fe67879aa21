"""What a task is: the user's plug-in that both the coordinator and the device agents load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import nn

MetricName = Literal["accuracy", "mse"]
PartitionScheme = Literal["iid", "dirichlet", "shards", "powerlaw", "groups"]


@dataclass(frozen=True)
class Split:
    """Inputs and targets of one split of one device's data, as tensors in memory."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            msg = (
                f"inputs and targets disagree on the sample count: "
                f"{self.inputs.shape[0]} != {self.targets.shape[0]}"
            )
            raise ValueError(msg)

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


@dataclass(frozen=True)
class DeviceData:
    """One device's private data: its own train, validation and test splits.

    `truth` holds generator ground truth where a task has one (e.g. the Gaussian task's theta_m),
    for tests and benchmarks only; it never leaves the device either.
    """

    device_index: int
    train: Split
    val: Split
    test: Split
    truth: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PartitionSpec:
    """How a pooled data set is split across devices (ignored by tasks that generate per device).

    scheme:
      iid:       uniform shuffle, equal sizes.
      dirichlet: label proportions per device ~ Dirichlet(alpha).
      shards:    each device holds `labels_per_device` labels, near-equal sizes.
      powerlaw:  `labels_per_device` labels per device with log-normal (power-law) sizes.
      groups:    FedeRiCo's label groups: the classes are cut into `groups` disjoint groups, each
                 device draws from exactly one, and a group's samples are shared near-equally.

    groups: Number of label groups D of the "groups" scheme.
    fraction: Share of the pooled data drawn at random (every scheme) before partitioning;
      1.0 uses the whole pool and draws nothing.
    """

    scheme: PartitionScheme = "dirichlet"
    alpha: float = 0.5
    labels_per_device: int = 2
    groups: int = 2
    fraction: float = 1.0
    test_fraction: float = 0.25
    val_fraction: float = 0.1


@runtime_checkable
class Task(Protocol):
    """A model factory, its loss and metric, the default personal parameters, and device data.

    `personal_patterns` are fnmatch patterns over `model.state_dict()` keys naming the parameters
    that personalization algorithms keep on the device by default (e.g. the output layer).
    A task that offers a choice of model also declares the class attribute `models` (the values
    its `model` option takes, e.g. ("cnn", "gru")); it is optional, so not a protocol member,
    and `--model` is refused for a task without it (`pfl_tasks.registry.options_with_model`).
    """

    name: ClassVar[str]
    metric_name: ClassVar[MetricName]
    personal_patterns: tuple[str, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def build_model(self, seed: int) -> nn.Module:
        """A fresh model whose initialization depends only on `seed`."""
        ...

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch; what local training minimizes."""
        ...

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Sum over the batch of the per-sample metric (correct count, or squared error)."""
        ...

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """All devices' data, deterministic in (num_devices, partition, seed)."""
        ...
