"""The digits task: scikit-learn's bundled 8x8 digits split non-IID, for an MLP or linear model."""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import ClassVar, Final, Literal

import numpy as np
import torch
from torch import nn

from pfl_tasks.base import DeviceData, PartitionSpec
from pfl_tasks.models import (
    Classification,
    SplitInputMLP,
    build_mlp,
    build_seeded,
    check_int,
)
from pfl_tasks.partition import fleet_from_pool

NUM_PIXELS: Final = 64
NUM_CLASSES: Final = 10
PIXEL_MAX: Final = 16.0
MODELS: Final = ("mlp", "split-input", "linear")


@functools.lru_cache(maxsize=1)
def load_digits_pool() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 bundled digits as (pixels in [0, 1] float32 (n, 64), labels int64), read once.

    scikit-learn is imported here rather than at module import so that devices running other
    tasks never pay for it.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = torch.from_numpy((bunch.data / PIXEL_MAX).astype(np.float32))
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    return pixels, labels


class DigitsTask(Classification):
    """8x8 digit classification: real images, no download, small enough for 100 virtual devices.

    Args:
        hidden: Width of the MLP's hidden layer (of each branch, for "split-input"; unused by
            "linear").
        model: "mlp"; "split-input": a `SplitInputMLP` whose shared branch sees the top four
            pixel rows and whose private branch (the "split-input" preset) the bottom four; or
            "linear": softmax regression, one Linear(64, 10) named `output` (650 parameters,
            federico.md 5.6's digits model), so the task's patterns and presets all name it.
        adapters: Bottleneck width of residual adapters after the hidden activation (0 = none;
            "mlp" only); the "adapters" preset makes them personal.
    """

    name: ClassVar[str] = "digits"
    models: ClassVar[tuple[str, ...]] = MODELS
    personal_patterns: tuple[str, ...] = ("output.*",)
    input_names: tuple[str, ...] = ("pixels",)
    input_preprocessing: ClassVar[str] = "pixels / 16: the 0-16 grey levels scaled to [0, 1]"
    output_names: tuple[str, ...] = ("logits",)

    def __init__(
        self,
        hidden: int = 64,
        model: Literal["mlp", "split-input", "linear"] = "mlp",
        adapters: int = 0,
    ) -> None:
        if model not in MODELS:
            msg = f"unknown model {model!r}; valid choices: {', '.join(MODELS)}"
            raise ValueError(msg)
        self.hidden = check_int("hidden", hidden)
        self.model = model
        self.adapters = check_int("adapters", adapters, minimum=0)
        if adapters and model != "mlp":
            msg = f"adapters are available for the mlp model only, not {model!r}"
            raise ValueError(msg)

    def build_model(self, seed: int) -> nn.Module:
        """A fresh model whose initialization (adapters included) depends only on `seed`."""
        if self.model == "split-input":
            half = NUM_PIXELS // 2
            return build_seeded(
                seed, lambda: SplitInputMLP(half, NUM_PIXELS - half, self.hidden, NUM_CLASSES)
            )
        if self.model == "linear":
            return build_seeded(
                seed, lambda: nn.Sequential(OrderedDict(output=nn.Linear(NUM_PIXELS, NUM_CLASSES)))
            )
        return build_mlp(seed, NUM_PIXELS, self.hidden, NUM_CLASSES, self.adapters)

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Partition the pooled digits across devices, then split each device.

        Each device's truth is what the partition scheme records (its label "group" under the
        "groups" scheme; nothing otherwise).

        Raises:
            ValueError: If the partition cannot be made (see `partition_labels`).
        """
        pixels, labels = load_digits_pool()
        return fleet_from_pool(pixels, labels.numpy(), labels, num_devices, partition, seed)
