"""Your own model and data as a task in a few lines: the common supervised case.

    from pfl_tasks.supervised import supervised_task

    task = supervised_task(
        "wine", model=lambda: nn.Sequential(...), inputs=x, targets=y, personal=("2.*",)
    )

`pfl-coord simulate --task mypackage.mymodule:task` then partitions the pooled arrays across
virtual devices with the built-in partitioners; for real devices, each agent reads its own
`--data` directory and only the model factory, loss and metric of the task are used. A folder
of such directories (`devices=`) simulates exactly the data the devices will hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, cast

import numpy as np
import torch
from torch import nn

from pfl_tasks.base import DeviceData, MetricName, PartitionSpec, Split, Task
from pfl_tasks.datadir import load_device_data
from pfl_tasks.fit_check import check_model_fits
from pfl_tasks.models import build_seeded, classification_loss, count_correct
from pfl_tasks.partition import fleet_from_pool

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ArrayLike = np.ndarray | torch.Tensor


class SupervisedTask:
    """A task from a model factory, a metric and either pooled arrays or device directories.

    Use `supervised_task`, which checks the pieces fit together before any round.
    """

    name: ClassVar[str] = "supervised"
    metric_name: ClassVar[MetricName] = "accuracy"

    def __init__(
        self,
        model: Callable[[], nn.Module],
        *,
        pool: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None,
        devices: Sequence[Path],
        personal: tuple[str, ...],
        loss: Loss | None,
        input_names: tuple[str, ...],
        output_names: tuple[str, ...],
    ) -> None:
        self._model = model
        self._pool = pool
        self._devices = tuple(devices)
        self._loss = loss
        self.personal_patterns = personal
        self.input_names = input_names
        self.output_names = output_names

    def build_model(self, seed: int) -> nn.Module:
        """The user's model, its initialization seeded so every run with `seed` starts equal."""
        return build_seeded(seed, self._model)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The given loss; else cross-entropy (accuracy) or mean squared error (mse)."""
        if self._loss is not None:
            return self._loss(outputs, targets)
        if self.metric_name == "accuracy":
            return classification_loss(outputs, targets)
        return torch.nn.functional.mse_loss(outputs, targets)

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Correct top-1 predictions (accuracy), or squared error summed per sample (mse)."""
        if self.metric_name == "accuracy":
            return count_correct(outputs, targets)
        per_sample = (outputs - targets).pow(2).reshape(outputs.shape[0], -1).mean(dim=1)
        return float(per_sample.sum())

    def make_fleet(self, num_devices: int, partition: PartitionSpec, seed: int) -> list[DeviceData]:
        """The first `num_devices` device directories, or the pool partitioned across them.

        Raises:
            ValueError: fewer directories than devices, a directory that does not load or fit
                the model, or a partition that cannot be made.
        """
        if self._pool is None:
            if num_devices > len(self._devices):
                msg = (
                    f"task {self.name!r} has {len(self._devices)} device directories, "
                    f"{num_devices} devices asked for"
                )
                raise ValueError(msg)
            fleet = []
            for index, directory in enumerate(self._devices[:num_devices]):
                data = load_device_data(directory, index)
                check_model_fits(cast(Task, self), data.train, str(directory))
                fleet.append(data)
            return fleet
        inputs, targets, labels = self._pool
        return fleet_from_pool(inputs, labels, targets, num_devices, partition, seed)


def supervised_task(
    name: str,
    model: Callable[[], nn.Module],
    *,
    inputs: ArrayLike | None = None,
    targets: ArrayLike | None = None,
    devices: str | os.PathLike[str] | None = None,
    metric: MetricName = "accuracy",
    personal: Sequence[str] = (),
    loss: Loss | None = None,
    groups: ArrayLike | None = None,
    input_names: Sequence[str] = ("inputs",),
    output_names: Sequence[str] = ("outputs",),
) -> Task:
    """A task for `model` trained on your data, checked against a few samples right away.

    Args:
        name: What runs, summaries and exports call the task.
        model: Builds a fresh model (no arguments); torch's seed is set before each call.
        inputs: Pooled inputs, one row per sample (with `targets`), for simulation.
        targets: Class labels (integers, `metric` "accuracy") or regression targets ("mse").
        devices: Instead of a pool, a folder whose subfolders are device `--data` directories
            (train.npz, test.npz and optionally val.npz); simulation uses them in name order.
        metric: "accuracy" (cross-entropy loss by default) or "mse" (squared error).
        personal: fnmatch patterns over `model().state_dict()` names kept on each device by
            default, e.g. ("head.*",); empty: the algorithm's own default.
        loss: Replaces the default loss: (outputs, targets) -> mean loss over the batch.
        groups: What the partitioners split a regression pool by (e.g. a site id per sample);
            classification pools are split by their labels. Without it a regression pool is one
            group, which the label-skew partitions cannot skew (they only vary the sizes).
        input_names: ONNX input names of the exported model.
        output_names: ONNX output names of the exported model.

    Raises:
        ValueError: neither or both of a pool and `devices`, arrays that disagree, a metric
            this helper does not know, or data the model cannot take (one line saying why).
    """
    if metric not in ("accuracy", "mse"):
        msg = f"metric must be 'accuracy' or 'mse', got {metric!r}"
        raise ValueError(msg)
    has_pool = inputs is not None or targets is not None
    if has_pool == (devices is not None):
        msg = "give either inputs= and targets= (a pool) or devices= (a folder of --data dirs)"
        raise ValueError(msg)
    task_type = type(
        f"{name.title().replace('-', '')}Task",
        (SupervisedTask,),
        {"name": name, "metric_name": metric},
    )
    pool = None
    directories: list[Path] = []
    if has_pool:
        pool = _pool(inputs, targets, groups, metric)
    else:
        root = Path(devices)  # type: ignore[arg-type]
        directories = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if not directories:
            msg = f"devices={str(root)!r} holds no device directories (one subfolder per device)"
            raise ValueError(msg)
    task = cast(
        Task,
        task_type(
            model,
            pool=pool,
            devices=directories,
            personal=tuple(personal),
            loss=loss,
            input_names=tuple(input_names),
            output_names=tuple(output_names),
        ),
    )
    if pool is not None:
        check_model_fits(task, Split(pool[0], pool[1]), "the pooled data")
    return task


def _pool(
    inputs: ArrayLike | None, targets: ArrayLike | None, groups: ArrayLike | None, metric: str
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Inputs as float32, targets as int64 labels or float32 values, and the partition labels."""
    if inputs is None or targets is None:
        msg = "give both inputs= and targets= for a pooled data set"
        raise ValueError(msg)
    features = torch.as_tensor(np.asarray(inputs), dtype=torch.float32)
    values = np.asarray(targets)
    if metric == "accuracy":
        if not np.issubdtype(values.dtype, np.integer):
            msg = f"accuracy needs integer class labels as targets, got {values.dtype}"
            raise ValueError(msg)
        labels = torch.as_tensor(values, dtype=torch.int64)
    else:
        labels = torch.as_tensor(values, dtype=torch.float32)
    if features.shape[0] != labels.shape[0]:
        msg = f"inputs have {features.shape[0]} samples, targets {labels.shape[0]}"
        raise ValueError(msg)
    if groups is not None:
        by = np.asarray(groups)
        if by.shape[:1] != (features.shape[0],):
            msg = f"groups= needs one entry per sample ({features.shape[0]}), got {by.shape}"
            raise ValueError(msg)
    elif metric == "accuracy":
        by = values.astype(np.int64)
    else:
        by = np.zeros(features.shape[0], dtype=np.int64)
    return features, labels, by
