"""The MNIST-1D task: 1-D signals of ten digit templates, generated offline, for a CNN or a GRU.

MNIST-1D (Greydanus 2020) turns ten 12-sample templates into 40-sample signals by random padding,
scaling, translation, correlated and i.i.d. noise and shear. It is small enough for a laptop yet
separates model families as real sensor data does (centrally: logistic regression 32%, MLP 68%,
GRU 91%, CNN 94% test accuracy in the paper). The data come from the `mnist1d` package's own
generator with its default arguments (5,000 signals, seed 42), never from its download.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import threading
from collections import OrderedDict
from typing import ClassVar, Final, Literal, get_args

import numpy as np
import torch
from torch import nn

from pfl_tasks.base import DeviceData, PartitionSpec, Split
from pfl_tasks.conv_models import SignalGru, SignalNorm, paper_cnn, signal_cnn
from pfl_tasks.models import Classification, build_mlp, build_seeded, check_int, check_real
from pfl_tasks.partition import fleet_from_pool
from pfl_tasks.signal_shift import device_sensor

SIGNAL_LENGTH: Final = 40
NUM_CLASSES: Final = 10
MODELS: Final = ("cnn", "cnn-bn", "cnn-paper", "gru", "mlp", "linear")
SHIFTS: Final = ("none", "feature")
NORMS: Final = get_args(SignalNorm)
DEFAULT_HIDDEN: Final = {"gru": 6, "mlp": 100}
"""Hidden widths of the paper's GRU (6 per direction) and MLP (100)."""

_GENERATOR_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Mnist1d:
    """The generated data set in the generator's own split: 4,000 train and 1,000 test signals."""

    train: Split
    test: Split

    def pool(self) -> Split:
        """Both splits as one pool of 5,000 signals, for partitioning across devices."""
        return Split(
            torch.cat((self.train.inputs, self.test.inputs)),
            torch.cat((self.train.targets, self.test.targets)),
        )


@functools.lru_cache(maxsize=1)
def generate_mnist1d() -> Mnist1d:
    """MNIST-1D from `mnist1d.data.make_dataset` with its default arguments, generated once.

    The generator seeds numpy's and Python's global random state; both are restored afterwards
    so that building the data shifts no caller's random stream. The package is imported here so
    that other tasks never load it (it imports matplotlib).
    """
    from mnist1d.data import get_dataset_args, make_dataset  # type: ignore[import-untyped]

    with _GENERATOR_LOCK:
        numpy_state, python_state = np.random.get_state(), random.getstate()
        try:
            data = make_dataset(get_dataset_args())
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)

    def split(inputs: np.ndarray, labels: np.ndarray) -> Split:
        return Split(
            torch.from_numpy(np.asarray(inputs, dtype=np.float32)),
            torch.from_numpy(np.asarray(labels, dtype=np.int64)),
        )

    return Mnist1d(train=split(data["x"], data["y"]), test=split(data["x_test"], data["y_test"]))


class Mnist1dTask(Classification):
    """MNIST-1D classification across devices: label skew by partition, feature shift by sensor.

    The 5,000 signals are pooled and split by the partition scheme (label skew: dirichlet,
    shards, powerlaw, ...). With `shift="feature"` each device also records its signals through
    its own sensor (gain, offset, noise, time warp; `pfl_tasks.signal_shift`), so under the
    "iid" partition devices share the classes and differ in their inputs only. Each device's
    truth records its sensor's draws.

    Args:
        model: "cnn" (`signal_cnn`, 17k parameters), "cnn-bn" (the same CNN with BatchNorm,
            whose running statistics FedBN keeps on each device), "cnn-paper" (`paper_cnn`, the
            paper's 5k CNN: strided convolutions, no normalization), "gru" (`SignalGru`, 5k),
            "mlp" (40 -> hidden -> 10, the paper's MLP at hidden 100) or "linear" (the paper's
            logistic regression, one Linear(40, 10) named `output`).
        shift: "none", or "feature": a sensor per device.
        shift_scale: Widens (> 1) or narrows (< 1) the sensors' ranges; 0 is no shift.
        channels: Convolution channels of the "cnn".
        norm: Normalization after each convolution: "group", "batch" or "none" (default:
            "group" for the "cnn", "batch" for the "cnn-bn", which takes no other).
        hidden: GRU state size per direction ("gru", default 6) or hidden width ("mlp", 100).
    """

    name: ClassVar[str] = "mnist1d"
    models: ClassVar[tuple[str, ...]] = MODELS
    personal_patterns: tuple[str, ...] = ("output.*",)
    input_names: tuple[str, ...] = ("signal",)
    input_preprocessing: ClassVar[str] = (
        "none: 40-sample signals as generated (centred, unit spread over the data set)"
    )
    output_names: tuple[str, ...] = ("logits",)

    def __init__(
        self,
        model: Literal["cnn", "cnn-bn", "cnn-paper", "gru", "mlp", "linear"] = "cnn",
        shift: Literal["none", "feature"] = "none",
        shift_scale: float = 1.0,
        channels: int = 48,
        norm: SignalNorm | None = None,
        hidden: int | None = None,
    ) -> None:
        for option, value, choices in (("model", model, MODELS), ("shift", shift, SHIFTS)):
            if value not in choices:
                msg = f"unknown {option} {value!r}; valid choices: {', '.join(choices)}"
                raise ValueError(msg)
        if norm is not None and norm not in NORMS:
            msg = f"unknown norm {norm!r}; valid choices: {', '.join(NORMS)}"
            raise ValueError(msg)
        if model == "cnn-bn" and norm not in (None, "batch"):
            msg = f"model 'cnn-bn' is the CNN with BatchNorm; norm {norm!r} contradicts it"
            raise ValueError(msg)
        self.model = model
        self.shift = shift
        self.shift_scale = check_real("shift_scale", shift_scale, bound="non-negative")
        self.channels = check_int("channels", channels)
        self.norm: SignalNorm = norm or ("batch" if model == "cnn-bn" else "group")
        self.hidden = check_int(
            "hidden", DEFAULT_HIDDEN.get(model, 1) if hidden is None else hidden
        )

    def build_model(self, seed: int) -> nn.Module:
        """A fresh model whose initialization depends only on `seed`."""
        if self.model == "gru":
            return build_seeded(seed, lambda: SignalGru(SIGNAL_LENGTH, NUM_CLASSES, self.hidden))
        if self.model == "cnn-paper":
            return build_seeded(seed, lambda: paper_cnn(SIGNAL_LENGTH, NUM_CLASSES))
        if self.model == "mlp":
            return build_mlp(seed, SIGNAL_LENGTH, self.hidden, NUM_CLASSES)
        if self.model == "linear":
            return build_seeded(
                seed,
                lambda: nn.Sequential(OrderedDict(output=nn.Linear(SIGNAL_LENGTH, NUM_CLASSES))),
            )
        return build_seeded(
            seed, lambda: signal_cnn(SIGNAL_LENGTH, NUM_CLASSES, self.channels, self.norm)
        )

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """Partition the pooled signals across devices, split each, then apply its sensor.

        Raises:
            ValueError: If the partition cannot be made (see `partition_labels`).
        """
        pool = generate_mnist1d().pool()
        fleet = fleet_from_pool(
            pool.inputs, pool.targets.numpy(), pool.targets, num_devices, partition, seed
        )
        if self.shift == "none":
            return fleet
        return [self._through_sensor(device, seed) for device in fleet]

    def _through_sensor(self, device: DeviceData, seed: int) -> DeviceData:
        """The device's splits as its sensor records them (noise drawn train, val, test)."""
        sensor, rng = device_sensor(seed, device.device_index, self.shift_scale)

        def record(split: Split) -> Split:
            return Split(sensor.apply(split.inputs, rng), split.targets)

        return dataclasses.replace(
            device,
            train=record(device.train),
            val=record(device.val),
            test=record(device.test),
            truth={**device.truth, **sensor.truth()},
        )
