"""Fixtures for the export tests: built-in tasks, a device's data, a quick trainer, provenance."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from torch import nn

from export import ExportProvenance, ExportResult, export_model
from pfl_tasks.base import DeviceData, PartitionSpec, Split, Task
from pfl_tasks.registry import load_task

Optimizer = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


class Fit(Protocol):
    """The `fit` fixture: `steps` full-batch steps of `optimizer` (default SGD at 0.5)."""

    def __call__(
        self,
        model: nn.Module,
        task: Task,
        split: Split,
        steps: int = 150,
        optimizer: Optimizer | None = None,
    ) -> nn.Module: ...


@pytest.fixture
def fit() -> Fit:
    """Full-batch training, enough to make a model clearly better than its initialization."""

    def train(
        model: nn.Module,
        task: Task,
        split: Split,
        steps: int = 150,
        optimizer: Optimizer | None = None,
    ) -> nn.Module:
        # One thread: these matrices are tiny, and spinning worker threads starve each other
        # when the test machine is busy (seconds instead of milliseconds).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            stepper = (optimizer or (lambda p: torch.optim.SGD(p, lr=0.5)))(model.parameters())
            model.train()
            for _ in range(steps):
                stepper.zero_grad()
                task.loss(model(split.inputs), split.targets).backward()
                stepper.step()
        finally:
            torch.set_num_threads(threads)
        return model.eval()

    return train


@pytest.fixture
def provenance() -> ExportProvenance:
    return ExportProvenance(
        algorithm="fedavg",
        round_id=7,
        device_id="kitchen-pi",
        chosen="personalized",
        personalized_metric=0.91,
        global_metric=0.84,
    )


@pytest.fixture
def digits() -> Task:
    return load_task("digits")


@pytest.fixture
def digits_device(digits: Task) -> DeviceData:
    return digits.make_fleet(4, PartitionSpec(scheme="iid"), seed=0)[0]


ExportDigits = Callable[..., ExportResult]


@pytest.fixture
def export_digits(
    tmp_path: Path, digits: Task, digits_device: DeviceData, provenance: ExportProvenance
) -> ExportDigits:
    """`export_model` on the digits task with test defaults; keyword arguments override them.

    Defaults: an untrained model (seed 0), `tmp_path / "model.onnx"`, no shared tensors, the
    device's test split as held-out data.
    """

    def run(
        model: nn.Module | None = None, path: Path | None = None, **options: Any
    ) -> ExportResult:
        arguments: dict[str, Any] = {
            "provenance": provenance,
            "shared": {},
            "heldout": digits_device.test,
            **options,
        }
        return export_model(
            digits.build_model(0) if model is None else model,
            digits,
            tmp_path / "model.onnx" if path is None else path,
            **arguments,
        )

    return run
