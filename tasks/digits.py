"""The digits task: scikit-learn's bundled 8x8 digits, split non-IID across devices, with an MLP."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar, Final, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from tasks.base import DeviceData, MetricName, PartitionSpec, Split
from tasks.partition import partition_indices, split_device

NUM_PIXELS: Final = 64
NUM_CLASSES: Final = 10
PIXEL_MAX: Final = 16.0

RealBound = Literal["any", "non-negative", "positive"]


def build_seeded(seed: int, factory: Callable[[], nn.Module]) -> nn.Module:
    """Build a model whose initialization depends on `seed` alone, leaving global RNG untouched.

    Devices and the coordinator must agree on the initial model without sharing RNG state, and a
    caller's own random stream must not shift because a model was built.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def make_mlp(in_features: int, hidden: int, out_features: int) -> nn.Sequential:
    """One-hidden-layer MLP whose last layer is named `output`, the default personal part."""
    return nn.Sequential(
        OrderedDict(
            hidden=nn.Linear(in_features, hidden),
            act=nn.ReLU(),
            output=nn.Linear(hidden, out_features),
        )
    )


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Validate an integer task option so a bad value fails as a ValueError, not deep in torch.

    Raises:
        ValueError: If `value` is not an integer of at least `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name} must be an integer >= {minimum}, got {value!r}"
        raise ValueError(msg)
    return value


def check_real(name: str, value: object, *, bound: RealBound = "non-negative") -> float:
    """Validate a real-valued task option against `bound`, as `check_int` does for integers.

    Raises:
        ValueError: If `value` is not a finite number within `bound`.
    """
    number = float("nan")
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        number = float(value)
    in_bound = {"any": True, "non-negative": number >= 0.0, "positive": number > 0.0}[bound]
    if not (np.isfinite(number) and in_bound):
        msg = f"{name} must be a finite number ({bound}), got {value!r}"
        raise ValueError(msg)
    return number


def classification_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch, from logits."""
    return functional.cross_entropy(outputs, targets)


def count_correct(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Number of correct top-1 predictions, so accuracy sums exactly across batches."""
    return float((outputs.argmax(dim=-1) == targets).sum().item())


@functools.lru_cache(maxsize=1)
def load_digits_pool() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 bundled digits as (pixels in [0, 1] float32 (n, 64), labels int64), read once.

    scikit-learn is imported here rather than at module import so that devices running other
    tasks never pay for it.
    """
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    bunch = load_digits()
    pixels = torch.from_numpy((bunch.data / PIXEL_MAX).astype(np.float32))
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    return pixels, labels


class DigitsTask:
    """8x8 digit classification: real images, no download, small enough for 100 virtual devices.

    Args:
        hidden: Width of the MLP's hidden layer.
    """

    name: ClassVar[str] = "digits"
    metric_name: ClassVar[MetricName] = "accuracy"
    personal_patterns: tuple[str, ...] = ("output.*",)
    input_names: tuple[str, ...] = ("pixels",)
    output_names: tuple[str, ...] = ("logits",)

    def __init__(self, hidden: int = 64) -> None:
        self.hidden = check_int("hidden", hidden)

    def build_model(self, seed: int) -> nn.Module:
        """A fresh MLP whose initialization depends only on `seed`."""
        return build_seeded(seed, lambda: make_mlp(NUM_PIXELS, self.hidden, NUM_CLASSES))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the batch."""
        return classification_loss(outputs, targets)

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Number of correct predictions in the batch."""
        return count_correct(outputs, targets)

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Partition the pooled digits across devices, then split each device.

        Raises:
            ValueError: If the partition cannot be made (see `partition_indices`).
        """
        pixels, labels = load_digits_pool()
        partition_rng, split_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)
        )
        parts = partition_indices(labels.numpy(), num_devices, partition, partition_rng)
        fleet = []
        for device_index, indices in enumerate(parts):
            train, val, test = (
                torch.from_numpy(idx) for idx in split_device(indices, partition, split_rng)
            )
            fleet.append(
                DeviceData(
                    device_index=device_index,
                    train=Split(pixels[train], labels[train]),
                    val=Split(pixels[val], labels[val]),
                    test=Split(pixels[test], labels[test]),
                )
            )
        return fleet
