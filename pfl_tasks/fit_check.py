"""Does a device's data fit the task's model? Checked once, before any round, in one clear line."""

from __future__ import annotations

import math

import torch

from pfl_tasks.base import Split, Task

PROBE_SAMPLES = 4
"""How many samples the check pushes through the model: enough to catch a shape mismatch."""


def check_model_fits(task: Task, split: Split, where: str) -> None:
    """Run a few samples of `split` through a fresh model, its loss and its metric.

    A wrong input shape or dtype, targets the loss cannot take, or class labels beyond the
    model's outputs would otherwise surface as a torch error in the middle of the first round.

    Raises:
        ValueError: one line naming `where`, the data's shapes and dtypes, and what failed.
    """
    if len(split) == 0:
        return
    inputs, targets = split.inputs[:PROBE_SAMPLES], split.targets[:PROBE_SAMPLES]
    described = (
        f"{where}: inputs of per-sample shape {tuple(inputs.shape[1:])} ({inputs.dtype}), "
        f"targets {tuple(targets.shape[1:])} ({targets.dtype})"
    )
    model = task.build_model(0)
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except Exception as error:  # any failure of the user's model is the answer
        raise _misfit(described, task, _reason(error)) from None
    problem = _target_problem(task, outputs, split.targets)
    if problem is not None:
        raise _misfit(described, task, problem)
    try:
        with torch.no_grad():
            loss = task.loss(outputs, targets)
            task.metric_sum(outputs, targets)
    except Exception as error:  # the user's loss or metric
        raise _misfit(described, task, _reason(error)) from None
    if not math.isfinite(float(loss)):
        raise _misfit(described, task, f"the loss of the first samples is {float(loss)}")


def _reason(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _misfit(described: str, task: Task, reason: str) -> ValueError:
    return ValueError(f"{described} do not fit the model of task {task.name!r}: {reason}")


def _target_problem(task: Task, outputs: torch.Tensor, targets: torch.Tensor) -> str | None:
    """What is wrong with the targets for the task's metric (torch may not say, or say late)."""
    if task.metric_name == "accuracy":
        if targets.is_floating_point():
            return f"class labels must be integers, got {targets.dtype}"
        classes = int(outputs.shape[-1])
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= classes:
            return f"labels span {low}..{high} but the model has {classes} outputs"
        return None
    if tuple(outputs.shape[1:]) != tuple(targets.shape[1:]):
        return (
            f"the model outputs per-sample shape {tuple(outputs.shape[1:])}, the targets are "
            f"{tuple(targets.shape[1:])}"
        )
    return None
