"""The Synthetic(alpha, beta) task: FedProx's per-device logistic-regression data generator."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar, Final, Literal

import numpy as np
import torch
from torch import nn

from pfl_tasks.base import DeviceData, PartitionSpec, Split
from pfl_tasks.models import (
    Classification,
    build_mlp,
    build_seeded,
    check_int,
    check_real,
)
from pfl_tasks.partition import MIN_DEVICE_SAMPLES, split_sizes

DIMENSION: Final = 60
NUM_CLASSES: Final = 10
SIZE_LOG_MEAN: Final = 4.0
SIZE_LOG_SIGMA: Final = 2.0
SIZE_OFFSET: Final = 50
MODELS: Final = ("mlp", "mclr")

# Per-coordinate variance j^(-1.2), j = 1..60: later features carry less signal.
_FEATURE_STD: Final = np.arange(1, DIMENSION + 1, dtype=np.float64) ** -0.6


class SyntheticTask(Classification):
    """Synthetic(alpha, beta) (Li et al. 2020, FedProx; reused by pFedMe): tunable heterogeneity.

    Per device k: u_k ~ N(0, alpha), B_k ~ N(0, beta), W_k ~ N(u_k, 1) (10 x 60),
    b_k ~ N(u_k, 1), v_k ~ N(B_k, 1) (60), x ~ N(v_k, diag(j^-1.2)), y = argmax(W_k x + b_k).
    alpha controls how much the devices' labelling functions differ, beta how much their inputs do.
    As in the FedProx reference generator, alpha and beta are passed to the normal draws as
    standard deviations (identical to variances at the usual 0 and 1).

    Device sizes are int(log-normal(4, 2)) + 50, capped at `max_samples` so a fleet of 1000 devices
    stays cheap. Data are generated per device, so the partition scheme is ignored; its test and
    validation fractions apply. Device k's data depend only on (seed, k), not on the fleet size.
    Each device's truth records its u_k ("model_mean") and B_k ("input_mean").

    Args:
        alpha: Spread of the devices' model means.
        beta: Spread of the devices' input means.
        model: "mlp" (60 -> hidden -> 10) or "mclr" (multinomial logistic regression).
        hidden: Hidden width of the "mlp" model.
        max_samples: Cap on a device's sample count.
        adapters: Bottleneck width of residual adapters after the hidden activation (0 = none;
            "mlp" only).
    """

    name: ClassVar[str] = "synthetic"
    models: ClassVar[tuple[str, ...]] = MODELS
    personal_patterns: tuple[str, ...] = ("output.*",)
    input_names: tuple[str, ...] = ("features",)
    output_names: tuple[str, ...] = ("logits",)

    def __init__(
        self,
        alpha: float = 1.0,
        beta: float = 1.0,
        model: Literal["mlp", "mclr"] = "mlp",
        hidden: int = 32,
        max_samples: int = 1000,
        adapters: int = 0,
    ) -> None:
        if model not in MODELS:
            msg = f"unknown model {model!r}; valid choices: {', '.join(MODELS)}"
            raise ValueError(msg)
        self.adapters = check_int("adapters", adapters, minimum=0)
        if adapters and model != "mlp":
            msg = f"adapters need a hidden layer: use model 'mlp', not {model!r}"
            raise ValueError(msg)
        self.alpha = check_real("alpha", alpha)
        self.beta = check_real("beta", beta)
        self.model = model
        self.hidden = check_int("hidden", hidden)
        self.max_samples = check_int("max_samples", max_samples, minimum=MIN_DEVICE_SAMPLES)

    def build_model(self, seed: int) -> nn.Module:
        """A fresh classifier whose initialization depends only on `seed`."""
        if self.model == "mclr":
            return build_seeded(
                seed, lambda: nn.Sequential(OrderedDict(output=nn.Linear(DIMENSION, NUM_CLASSES)))
            )
        return build_mlp(seed, DIMENSION, self.hidden, NUM_CLASSES, self.adapters)

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Generate every device's data from its own seed-derived stream.

        Raises:
            ValueError: If `num_devices` is not positive or the split fractions are invalid.
        """
        check_int("num_devices", num_devices)
        streams = np.random.SeedSequence(seed).spawn(num_devices)
        return [
            self._make_device(k, np.random.default_rng(stream), partition)
            for k, stream in enumerate(streams)
        ]

    def _make_device(
        self, device_index: int, rng: np.random.Generator, partition: PartitionSpec
    ) -> DeviceData:
        num_samples = min(
            int(rng.lognormal(SIZE_LOG_MEAN, SIZE_LOG_SIGMA)) + SIZE_OFFSET, self.max_samples
        )
        model_mean = rng.normal(0.0, self.alpha)
        input_mean = rng.normal(0.0, self.beta)
        weights = rng.normal(model_mean, 1.0, size=(DIMENSION, NUM_CLASSES))
        bias = rng.normal(model_mean, 1.0, size=NUM_CLASSES)
        centre = rng.normal(input_mean, 1.0, size=DIMENSION)
        features = centre + rng.standard_normal((num_samples, DIMENSION)) * _FEATURE_STD
        labels = np.argmax(features @ weights + bias, axis=1)
        inputs = torch.from_numpy(features.astype(np.float32))
        targets = torch.from_numpy(labels.astype(np.int64))
        # Samples are i.i.d. within a device, so contiguous cuts are as good as a shuffle.
        num_train, num_val, _ = split_sizes(num_samples, partition)
        cuts = (slice(0, num_train), slice(num_train, num_train + num_val))
        return DeviceData(
            device_index=device_index,
            train=Split(inputs[cuts[0]], targets[cuts[0]]),
            val=Split(inputs[cuts[1]], targets[cuts[1]]),
            test=Split(inputs[num_train + num_val :], targets[num_train + num_val :]),
            truth={"model_mean": float(model_mean), "input_mean": float(input_mean)},
        )
