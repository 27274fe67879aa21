"""What every peer's run shares: the workload's files, its model, its minibatch order and its score.

The harness (`benchmarks.peers_harness`) writes a workload as `workload.json` (settings, the
model's layers) and `workload.npz` (every device's train and test split, the initial weights);
every runner reads them here, so each framework trains the same model from the same weights on
the same devices' data in the same minibatch order. Plain numpy and torch only: this module is
imported inside the peers' own environments.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

LAYERS: dict[str, Callable[..., nn.Module]] = {
    "Linear": nn.Linear,
    "ReLU": nn.ReLU,
    "Conv1d": nn.Conv1d,
    "GroupNorm": nn.GroupNorm,
    "MaxPool1d": nn.MaxPool1d,
    "Flatten": nn.Flatten,
    "Unflatten": nn.Unflatten,
}
"""The layer types a workload's model may use, by class name (an nn.Sequential of them)."""


@dataclass(frozen=True)
class Device:
    """One device's train and test split."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


@dataclass(frozen=True)
class Workload:
    """A workload as the harness wrote it."""

    settings: dict[str, Any]
    layers: list[tuple[str, str, dict[str, Any]]]
    initial: OrderedDict[str, torch.Tensor]
    devices: list[Device]

    @property
    def rounds(self) -> int:
        """Training rounds (central iterations)."""
        return int(self.settings["rounds"])

    @property
    def lr(self) -> float:
        """Local SGD's learning rate."""
        return float(self.settings["lr"])

    @property
    def batch_size(self) -> int:
        """Local minibatch size."""
        return int(self.settings["batch_size"])

    @property
    def local_epochs(self) -> int:
        """Passes over a device's train split per round."""
        return int(self.settings["local_epochs"])

    def build_model(self) -> nn.Sequential:
        """The workload's model with its initial weights."""
        model = nn.Sequential(
            OrderedDict((name, LAYERS[kind](**kwargs)) for kind, name, kwargs in self.layers)
        )
        model.load_state_dict(self.initial)
        return model


def load_workload(directory: Path) -> Workload:
    """Read a workload the harness wrote (no pickle: `allow_pickle=False`)."""
    described = json.loads((directory / "workload.json").read_text())
    with np.load(directory / "workload.npz", allow_pickle=False) as arrays:

        def tensor(key: str) -> torch.Tensor:
            return torch.from_numpy(np.array(arrays[key]))

        devices = [
            Device(*(tensor(f"{part}_{i}") for part in ("train_x", "train_y", "test_x", "test_y")))
            for i in range(int(described["settings"]["devices"]))
        ]
        initial = OrderedDict((name, tensor(f"init_{name}")) for name in described["state"])
    layers = [(kind, name, kwargs) for kind, name, kwargs in described["layers"]]
    return Workload(described["settings"], layers, initial, devices)


def epoch_orders(size: int, round_index: int, device: int, epochs: int) -> list[torch.Tensor]:
    """A device's sample order in each epoch of a round (0-based): one generator per pair.

    Every runner that can choose its order uses these, so their runs differ only in the
    framework around the same steps.
    """
    generator = torch.Generator().manual_seed(round_index * 1_000_003 + device)
    return [torch.randperm(size, generator=generator) for _ in range(epochs)]


def local_sgd(model: nn.Module, workload: Workload, device: int, round_index: int) -> None:
    """The local update: `local_epochs` passes of torch.optim.SGD in `epoch_orders`."""
    data = workload.devices[device]
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr)
    for order in epoch_orders(len(data.train_y), round_index, device, workload.local_epochs):
        for start in range(0, len(order), workload.batch_size):
            index = order[start : start + workload.batch_size]
            optimizer.zero_grad()
            loss(model(data.train_x[index]), data.train_y[index]).backward()
            optimizer.step()


def warm_up(workload: Workload) -> None:
    """One SGD step of a throwaway copy of the model, before any clock starts.

    torch sets its optimizers up on first use (about a second here); every runner pays that
    here, so no run's in-run time holds it.
    """
    model, data = workload.build_model(), workload.devices[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr)
    batch = slice(0, workload.batch_size)
    loss(model(data.train_x[batch]), data.train_y[batch]).backward()
    optimizer.step()


def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch (the tasks' classification loss)."""
    return nn.functional.cross_entropy(outputs, targets)


@torch.no_grad()
def mean_accuracy(model: nn.Module, devices: Sequence[Device]) -> float:
    """The unweighted mean over devices of `model`'s accuracy on each device's test split."""
    scores = [float((model(d.test_x).argmax(dim=1) == d.test_y).float().mean()) for d in devices]
    return sum(scores) / len(scores)


class RoundClock:
    """In-run time, taken the same way in every runner: first round's start to last round's end.

    A round starts when the framework hands the first device its model and ends when the new
    global model exists; start-up before and the final evaluation after are outside.
    """

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_end: float | None = None

    def round_started(self) -> None:
        """Mark a round's start (only the first one counts)."""
        if self.first_start is None:
            self.first_start = time.perf_counter()

    def round_ended(self) -> None:
        """Mark a round's end (the last one counts)."""
        self.last_end = time.perf_counter()

    def seconds(self) -> float:
        """From the first start to the last end.

        Raises:
            RuntimeError: no round both started and ended.
        """
        if self.first_start is None or self.last_end is None:
            msg = "the run never started or never finished a round"
            raise RuntimeError(msg)
        return self.last_end - self.first_start


def runner_arguments(description: str) -> argparse.Namespace:
    """A runner's command line: the workload's directory and where its result goes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the runner")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    return arguments


def ready_workload(directory: Path) -> Workload:
    """The workload read and torch warmed up on it (`warm_up`): what a run starts from."""
    workload = load_workload(directory)
    warm_up(workload)
    return workload


def start_run(description: str) -> tuple[argparse.Namespace, Workload]:
    """A runner's start: its command line (`runner_arguments`) and its `ready_workload`."""
    arguments = runner_arguments(description)
    return arguments, ready_workload(arguments.workload)


def write_result(
    path: Path, seconds: float, accuracy: float, packages: Sequence[str], **extra: Any
) -> None:
    """The runner's result for the harness: in-run seconds, accuracy, versions (JSON)."""
    versions = {name: metadata.version(name) for name in ("torch", *packages)}
    versions["python"] = platform.python_version()
    document = {"in_run_s": seconds, "accuracy": accuracy, "versions": versions, **extra}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document))
    partial.replace(path)  # the harness never reads half a result
