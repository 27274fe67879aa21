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
from dataclasses import dataclass, field

import torch
from torch import nn

from device_agent.algorithms.base import BatchPhase
from device_agent.batched.flat_sgd import FlatLayout, FlatSgd
from device_agent.batched.forward import Forward, sample_losses, stacked_forward
from device_agent.batched.schedule import schedule
from device_agent.training import TrainSpec, TrainStats
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
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The device's kept algorithm state, which a phase may start from (`from_state`)."""


@dataclass(frozen=True)
class Trained:
    """One member's outcome: final parameters, each phase's stats, the tensors phases kept."""

    final: Tensors
    stats: list[TrainStats]
    kept: Tensors


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
) -> list[Trained]:
    """Train every member through `phases` together, each as `run_phases` trains one device.

    The returned final tensors are views of one stacked copy (copy what is kept).

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
    kept: list[Tensors] = [{} for _ in members]
    for phase in phases:
        if phase.restart:
            flat.copy_(layout.stack([m.start for m in members]))
        if phase.from_state is not None:
            rows = zip(members, layout.rows(flat), strict=True)
            flat.copy_(
                layout.stack([_stored(m, row, phase.from_state, phase.spec) for m, row in rows])
            )
        reference = _proximal_reference(layout, members, phase)
        trained = _phase(forward, task, layout, flat, data, phase, reference)
        for member_stats, phase_stats in zip(stats, trained, strict=True):
            member_stats.append(phase_stats)
        if phase.kept_as is not None:
            for member_kept, row in zip(kept, layout.rows(flat), strict=True):
                member_kept.update({phase.kept_as + n: row[n] for n in phase.spec.trainable})
    return [
        Trained(final, member_stats, member_kept)
        for final, member_stats, member_kept in zip(layout.rows(flat), stats, kept, strict=True)
    ]


def _stored(member: Member, row: Tensors, prefix: str, spec: TrainSpec) -> dict[str, torch.Tensor]:
    """`row` with the trainable tensors kept under `prefix` (all of them, or else the start's)."""
    keys = [prefix + name for name in spec.trainable]
    if all(key in member.state for key in keys):
        chosen = {name: member.state[key] for name, key in zip(spec.trainable, keys, strict=True)}
    else:
        chosen = {name: member.start[name] for name in spec.trainable}
    return {**row, **chosen}


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
    if phase.proximal_to_received:  # the phase's trainable parameters toward the whole start
        named = [n for n in layout.names if n in phase.spec.trainable]
        rows = [m.start for m in members]
    else:
        named = [n for n in layout.names if n in members[0].reference]
        rows = [{**m.start, **m.reference} for m in members]  # columns outside the term unused
    columns = layout.columns(dict.fromkeys(named, 1.0)).unsqueeze(0)
    return phase.proximal_mu, layout.stack(rows), columns
