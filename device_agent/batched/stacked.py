"""Many devices' local training as one stacked computation.

Every device's parameters are one row of a flat [D, P] tensor (`flat_sgd.FlatLayout`); a step
is one gather of every device's minibatch (laid out for the whole phase by `schedule`), one
forward pass of the D models (`forward.stacked_forward`: batched matrix products for an MLP),
one backward over the sum of the devices' losses (device i's loss depends on its row alone, so
each row gets its own gradient) and one SGD update. Rows are ordered by their number of
steps, so a step trains the first rows only, the devices that still have one; a device's short
last batch is padded and masked. Each device's trajectory is the one the per-device loop takes,
to floating-point rounding (sums in another order). Nothing synchronizes inside the loop: the
losses and the finiteness of gradients are read once, when the phase ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from device_agent.algorithms.base import BatchPhase
from device_agent.batched.flat_sgd import FlatLayout, FlatSgd
from device_agent.batched.forward import Forward, sample_losses, stacked_forward
from device_agent.batched.schedule import schedule
from device_agent.training import TrainStats
from pfl_tasks.base import Split, Task
from protocols.codec import Tensors
from protocols.errors import TrainingError


@dataclass(frozen=True)
class Member:
    """One device's part of a stacked round: its data, generator and starting tensors."""

    split: Split
    generator: torch.Generator
    start: Mapping[str, torch.Tensor]
    """Every parameter's starting value (received shared + this device's personal part)."""
    reference: Mapping[str, torch.Tensor]
    """The received shared tensors, which proximal terms pull toward."""


def model_problem(model: nn.Module) -> str | None:
    """Why `model` cannot train stacked (None: it can)."""
    if any(True for _ in model.buffers()):
        return "the model has buffers (e.g. BatchNorm statistics), which stay per device"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return "dropout draws from the process's random stream, not the device's generator"
    if len({p.dtype for p in model.parameters()}) > 1:
        return "the model's parameters differ in dtype, so they cannot share one tensor"
    return None


@dataclass(frozen=True)
class _Data:
    """The members' splits concatenated: one gather per step picks every device's batch."""

    inputs: torch.Tensor
    targets: torch.Tensor
    counts: list[int]
    generators: list[torch.Generator]


def train_stacked(
    model: nn.Module, task: Task, members: Sequence[Member], phases: Sequence[BatchPhase]
) -> list[tuple[Tensors, list[TrainStats]]]:
    """Train every member through `phases` together: final parameters and stats per phase.

    The returned tensors are views of one stacked copy (copy what is kept).

    Raises:
        TrainingError: some device's loss or gradient became non-finite.
    """
    forward, transposed = stacked_forward(model)
    layout = FlatLayout(model, transposed)
    flat = layout.stack([m.start for m in members])
    data = _Data(
        inputs=torch.cat([m.split.inputs for m in members]),
        targets=torch.cat([m.split.targets for m in members]),
        counts=[len(m.split) for m in members],
        generators=[m.generator for m in members],
    )
    stats: list[list[TrainStats]] = [[] for _ in members]
    for phase in phases:
        reference = _proximal_reference(layout, members, phase)
        trained = _phase(forward, task, layout, flat, data, phase, reference)
        for kept, phase_stats in zip(stats, trained, strict=True):
            kept.append(phase_stats)
    return list(zip(layout.rows(flat), stats, strict=True))


def _phase(
    forward: Forward,
    task: Task,
    layout: FlatLayout,
    flat: torch.Tensor,
    data: _Data,
    phase: BatchPhase,
    reference: tuple[float, torch.Tensor, torch.Tensor] | None,
) -> list[TrainStats]:
    """Train `flat`'s rows through one phase, in place; each device's stats.

    Raises:
        ValueError: the phase names tensors that are not parameters (the per-device path,
            which the trainer falls back to, says which).
    """
    spec = phase.spec
    if not set(spec.trainable) | set(spec.lr_by_name) <= set(layout.names):
        msg = "the phase trains tensors that are not parameters"
        raise ValueError(msg)
    plan = schedule(data.counts, spec, data.generators)
    if not any(plan.steps):
        return [TrainStats(0, 0, 0.0) for _ in data.counts]
    devices = len(data.counts)
    order = torch.tensor(sorted(range(devices), key=lambda d: -plan.steps[d]))  # stable
    live = plan.active[:, order].sum(dim=1).tolist()  # devices training at each step: a prefix
    index, mask = plan.index[:, order], plan.mask[:, order]
    counts = mask.sum(dim=2)  # [steps, devices]
    work = flat[order]
    optimizer = FlatSgd(spec, layout)
    sums = torch.zeros(devices, dtype=torch.float64)
    for step, n in enumerate(live):
        rows = work[:n].detach().requires_grad_(True)  # shares work's storage
        outputs = forward(layout.views(rows), data.inputs[index[step, :n]])
        per_sample = sample_losses(task, outputs, data.targets[index[step, :n]])
        loss = torch.where(mask[step, :n], per_sample, 0.0).sum(dim=1) / counts[step, :n]
        total = loss
        if reference is not None:
            mu, values, columns = reference
            total = total + 0.5 * mu * ((rows - values[order[:n]]) ** 2 * columns).sum(dim=1)
        total.sum().backward()
        assert rows.grad is not None
        optimizer.step(rows, rows.grad, devices)
        sums[:n] += loss.detach().double() * counts[step, :n]
    flat[order] = work
    totals = torch.empty_like(sums)
    totals[order] = sums
    if not bool(optimizer.finite):
        msg = "a gradient became non-finite"
        raise TrainingError(msg)
    result = []
    for steps, samples, total_loss in zip(plan.steps, plan.samples, totals.tolist(), strict=True):
        mean = total_loss / samples if samples else 0.0
        if not math.isfinite(mean):
            msg = f"training loss became {mean}"
            raise TrainingError(msg)
        result.append(TrainStats(steps, samples, mean))
    return result


def _proximal_reference(
    layout: FlatLayout, members: Sequence[Member], phase: BatchPhase
) -> tuple[float, torch.Tensor, torch.Tensor] | None:
    """(mu, [D, P] received values, [1, P] columns the term covers), or None without a term."""
    if phase.proximal_mu is None:
        return None
    named = [n for n in layout.names if n in members[0].reference]
    rows = [{**m.start, **m.reference} for m in members]  # columns outside the term unused
    columns = layout.columns(dict.fromkeys(named, 1.0)).unsqueeze(0)
    return phase.proximal_mu, layout.stack(rows), columns
