"""Many devices' local training as one stacked computation.

Each parameter is stacked along a leading device dimension; one forward pass is
`torch.func.functional_call` under `torch.func.vmap`, one backward goes over the sum of the
devices' losses (device i's loss depends on its slice alone, so each slice gets its own
gradient), and one masked SGD step moves every device still training. Each device draws its
minibatches from its own generator exactly as `device_agent.training.minibatches` does; a
device with fewer samples or steps is padded and masked, so its trajectory is the one the
per-device loop takes, to floating-point rounding (sums in another order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap

from device_agent.algorithms.base import BatchPhase
from device_agent.training import TrainSpec, TrainStats, minibatches
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
    return None


def train_stacked(
    model: nn.Module, task: Task, members: Sequence[Member], phases: Sequence[BatchPhase]
) -> list[tuple[Tensors, list[TrainStats]]]:
    """Train every member through `phases` together: final parameters and stats per phase.

    Raises:
        TrainingError: some device's loss or gradient became non-finite.
    """
    names = [name for name, _ in model.named_parameters()]
    state = {name: torch.stack([m.start[name].detach() for m in members]) for name in names}
    stats: list[list[TrainStats]] = [[] for _ in members]
    for phase in phases:
        trained = _phase(model, task, members, phase, state)
        for kept, phase_stats in zip(stats, trained, strict=True):
            kept.append(phase_stats)
    return [
        ({name: state[name][i].detach().clone() for name in names}, stats[i])
        for i in range(len(members))
    ]


def _schedule(split: Split, spec: TrainSpec, generator: torch.Generator) -> list[torch.Tensor]:
    """The sample indices of each step, drawn as `device_agent.training.train` draws them."""
    count = len(split)
    if not spec.trainable or count == 0:
        return []
    positions = Split(torch.arange(count), torch.arange(count))
    batches: list[torch.Tensor] = []
    for index, _ in minibatches(positions, spec.batch_size, spec.epochs, generator):
        if spec.max_steps is not None and len(batches) >= spec.max_steps:
            break
        batches.append(index)
    return batches


def _phase(
    model: nn.Module,
    task: Task,
    members: Sequence[Member],
    phase: BatchPhase,
    state: dict[str, torch.Tensor],
) -> list[TrainStats]:
    spec = phase.spec
    schedules = [_schedule(m.split, spec, m.generator) for m in members]
    steps = max((len(s) for s in schedules), default=0)
    if steps == 0:
        return [TrainStats(0, 0, 0.0) for _ in members]
    index, mask = _padded(schedules, [len(m.split) for m in members], spec.batch_size)
    inputs = torch.cat([m.split.inputs for m in members])
    targets = torch.cat([m.split.targets for m in members])
    counts = mask.sum(dim=2)  # [steps, devices]
    active = counts > 0
    reference = _proximal_reference(members, phase, state)
    optimizer = _StackedSgd(spec, state)
    losses = []
    for step in range(steps):
        loss = _backward(
            model, task, state, inputs[index[step]], targets[index[step]], mask[step], reference
        )
        losses.append(loss)
        optimizer.step(active[step])
    per_step = torch.stack(losses).double()  # [steps, devices]
    sizes = counts.double()
    result = []
    for i, schedule in enumerate(schedules):
        samples = int(sizes[:, i].sum())
        mean = float(per_step[:, i] @ sizes[:, i]) / samples if samples else 0.0
        if not math.isfinite(mean):
            msg = f"training loss became {mean}"
            raise TrainingError(msg)
        result.append(TrainStats(len(schedule), samples, mean))
    return result


def _padded(
    schedules: Sequence[list[torch.Tensor]], lengths: Sequence[int], batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global sample indices [steps, devices, batch] into the concatenated splits, and a mask."""
    steps = max(len(s) for s in schedules)
    index = torch.zeros(steps, len(schedules), batch, dtype=torch.long)
    mask = torch.zeros(steps, len(schedules), batch)
    offset = 0
    for device, (schedule, length) in enumerate(zip(schedules, lengths, strict=True)):
        for step, chosen in enumerate(schedule):
            index[step, device, : len(chosen)] = chosen + offset
            mask[step, device, : len(chosen)] = 1.0
        offset += length
    return index, mask


def _proximal_reference(
    members: Sequence[Member], phase: BatchPhase, state: Mapping[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]] | None:
    if phase.proximal_mu is None:
        return None
    names = [name for name in members[0].reference if name in state]
    return phase.proximal_mu, {
        name: torch.stack([m.reference[name] for m in members]) for name in names
    }


def _backward(
    model: nn.Module,
    task: Task,
    state: dict[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    reference: tuple[float, dict[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """Backpropagate every device's minibatch loss at once; the devices' task losses."""

    def forward(parameters: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = functional_call(model, parameters, (x,))
        return output

    def sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return task.loss(output.unsqueeze(0), target.unsqueeze(0))

    outputs = vmap(forward)(state, inputs)
    devices, batch = mask.shape
    flat = vmap(sample_loss)(outputs.flatten(0, 1), targets.flatten(0, 1))
    per_sample = flat.view(devices, batch)
    counts = mask.sum(dim=1)
    losses = (per_sample * mask).sum(dim=1) / counts.clamp(min=1.0)
    total = losses
    if reference is not None:
        mu, values = reference
        distance = sum(
            ((state[name] - value) ** 2).flatten(1).sum(dim=1) for name, value in values.items()
        )
        total = total + 0.5 * mu * distance
    (total * (counts > 0)).sum().backward()
    return losses.detach()


class _StackedSgd:
    """torch.optim.SGD's arithmetic (weight decay, momentum, no dampening) on stacked tensors.

    Devices whose steps are over stay as they are (and keep their momentum); clipping is each
    device's own, as `clip_grad_norm_` on its parameters alone.
    """

    def __init__(self, spec: TrainSpec, state: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.trainable = [
            (state[name], spec.lr_by_name.get(name, spec.lr)) for name in spec.trainable
        ]
        trainable = set(spec.trainable)
        for name, value in state.items():
            value.requires_grad_(name in trainable)
        self.momentum: list[torch.Tensor | None] = [None] * len(self.trainable)

    def step(self, active: torch.Tensor) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in self.trainable]
        spec = self.spec
        with torch.no_grad():
            if spec.clip_grad_norm is not None:
                self._clip(grads, active, spec.clip_grad_norm)
            for k, ((parameter, lr), grad) in enumerate(zip(self.trainable, grads, strict=True)):
                where = active.view(-1, *([1] * (parameter.dim() - 1)))
                if spec.weight_decay:
                    grad = grad.add(parameter, alpha=spec.weight_decay)
                if spec.momentum:
                    buffer = self.momentum[k]
                    if buffer is None:
                        buffer = torch.where(where, grad, torch.zeros_like(grad))
                    else:
                        buffer = torch.where(where, buffer * spec.momentum + grad, buffer)
                    self.momentum[k] = buffer
                    grad = buffer
                parameter.copy_(torch.where(where, parameter.add(grad, alpha=-lr), parameter))
                parameter.grad = None

    @staticmethod
    def _clip(grads: list[torch.Tensor], active: torch.Tensor, max_norm: float) -> None:
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])
        total = torch.linalg.vector_norm(norms, dim=0)  # [devices]
        if not bool(torch.isfinite(total[active]).all()):
            msg = "a gradient became non-finite"
            raise TrainingError(msg)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale.view(-1, *([1] * (grad.dim() - 1))))
