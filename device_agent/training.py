"""The one local training loop every algorithm uses, and the tensor arithmetic they share.

Micro-batching with gradient accumulation, clipping, non-finite checks and a step budget that spans
epochs live here once; an algorithm says which parameters train and adds a loss term.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from device_agent.checkpointing import Forward, checkpointed
from device_agent.work_limits import WorkMeter
from pfl_tasks.base import Split, Task
from protocols.codec import Tensors
from protocols.errors import TrainingError

ExtraLoss = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class StepBudget:
    """How one optimizer step is bounded.

    `micro_batch_size` and `checkpointing` (recompute the model's top-level blocks in
    backward) come from the memory plan (None = whole batch); `meter` counts the round's steps
    and time against the device's ceilings (None = no ceilings).
    """

    micro_batch_size: int | None = None
    meter: WorkMeter | None = None
    checkpointing: bool = False


@dataclass(frozen=True)
class TrainSpec:
    """One training phase: which tensors move, for how long, and how.

    `lr_by_name` gives some trainable tensors their own step size (the rest use `lr`); each
    step still takes one minibatch and one backward pass for all of them (FedSim, spec §1.4).
    """

    trainable: tuple[str, ...]
    epochs: int
    batch_size: int
    lr: float
    max_steps: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    lr_by_name: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainStats:
    """What a phase did: optimizer steps, samples seen and their mean loss."""

    steps: int
    samples: int
    mean_loss: float


def combine_stats(*phases: TrainStats) -> TrainStats:
    """One round's totals over its phases: steps and samples add, losses weigh by samples."""
    samples = sum(phase.samples for phase in phases)
    loss = sum(phase.mean_loss * phase.samples for phase in phases) / samples if samples else 0.0
    return TrainStats(sum(phase.steps for phase in phases), samples, loss)


def minibatches(
    split: Split,
    batch_size: int,
    epochs: int,
    generator: torch.Generator,
    *,
    min_batch: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled minibatches over `epochs` passes; the last batch of a pass may be smaller.

    A last batch below `min_batch` joins the one before it (BatchNorm cannot train on one
    sample); the shuffle is the same either way.
    """
    count = len(split)
    bounds = chunks(count, batch_size, min_batch)
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator)
        for start, end in bounds:
            index = order[start:end]
            yield split.inputs[index], split.targets[index]


def chunks(count: int, size: int, least: int = 1) -> list[tuple[int, int]]:
    """[start, end) bounds of `count` rows in pieces of `size`.

    A last piece of fewer than `least` rows joins the one before it.
    """
    starts = list(range(0, count, size))
    if len(starts) > 1 and count - starts[-1] < least:
        starts.pop()
    return list(zip(starts, [*starts[1:], count], strict=True))


@torch.no_grad()
def estimate_statistics(model: nn.Module, names: Collection[str], split: Split) -> bool:
    """Re-estimate the running statistics among `names` from `split`, in place (AdaBN).

    For a device that keeps no state: its own statistics would otherwise restart every round
    from the coordinator's initial values, which describe no data. Each BatchNorm holding one
    of `names` is reset and takes the cumulative average over one pass of `split` (momentum
    None), in batches of 2 or more rows; nothing else changes, and the model's mode is restored.
    Returns whether any statistic was re-estimated.
    """
    layers = [
        module
        for prefix, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and f"{prefix}.running_mean" in names
    ]
    if not layers or len(split) < 2:
        return False
    momenta = [layer.momentum for layer in layers]
    modes = {module: module.training for module in model.modules()}
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None
    model.eval()
    for layer in layers:  # only these layers update: the others normalize as in evaluation
        layer.train()
    try:
        for start, end in chunks(len(split), 256, 2):
            model(split.inputs[start:end])
    finally:
        for layer, momentum in zip(layers, momenta, strict=True):
            layer.momentum = momentum
        for module, training in modes.items():
            module.training = training
    return True


def has_batch_norm(model: nn.Module) -> bool:
    """Whether some layer normalizes by batch statistics in training (needs 2+ samples)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def train(
    model: nn.Module,
    task: Task,
    split: Split,
    spec: TrainSpec,
    generator: torch.Generator,
    *,
    budget: StepBudget | None = None,
    extra_loss: ExtraLoss | None = None,
) -> TrainStats:
    """Run plain SGD on `spec.trainable`; every other parameter is frozen (no gradient kept).

    Gradients are released when the phase ends, so no phase inherits another's.

    Raises:
        ValueError: `spec` names tensors that are not trainable parameters.
        TrainingError: the loss or the gradient became non-finite.
    """
    parameters = dict(model.named_parameters())
    unknown = [name for name in spec.trainable if name not in parameters]
    stray = [name for name in spec.lr_by_name if name not in spec.trainable]
    if unknown or stray:
        msg = (
            f"cannot train tensors that are not parameters ({', '.join(unknown) or '-'}) or "
            f"set learning rates of tensors that do not train ({', '.join(stray) or '-'})"
        )
        raise ValueError(msg)
    trainable = [parameters[name] for name in spec.trainable]
    if not trainable or len(split) == 0:
        return TrainStats(0, 0, 0.0)
    least = 2 if has_batch_norm(model) else 1  # BatchNorm cannot train on one sample
    if len(split) < least:
        msg = "a model with BatchNorm cannot train on a single sample: this device has one"
        raise TrainingError(msg)
    wanted = set(spec.trainable)
    frozen = [p for name, p in parameters.items() if name not in wanted]
    for parameter in frozen:  # no gradient is computed or kept for them
        parameter.requires_grad_(False)
    step = _optimizer_step(spec, parameters)
    micro = budget.micro_batch_size if budget is not None else None
    meter = budget.meter if budget is not None else None
    forward = checkpointed(model) if budget is not None and budget.checkpointing else model
    _set_mode(model, training=True)
    steps = 0
    losses: list[torch.Tensor] = []
    sizes: list[int] = []
    try:
        batches = minibatches(split, spec.batch_size, spec.epochs, generator, min_batch=least)
        for inputs, targets in batches:
            if spec.max_steps is not None and steps >= spec.max_steps:
                break
            _release_gradients(trainable)
            batch_loss = _accumulate(forward, task, (inputs, targets), (micro, least), extra_loss)
            if spec.clip_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(trainable, spec.clip_grad_norm)
                if not math.isfinite(float(norm)):
                    msg = "a gradient became non-finite"
                    raise TrainingError(msg)
            step()
            steps += 1
            if meter is not None:
                meter.tick()
            losses.append(batch_loss.detach())
            sizes.append(int(inputs.shape[0]))
    finally:
        _release_gradients(trainable)
        for parameter in frozen:
            parameter.requires_grad_(True)
    samples = sum(sizes)
    mean_loss = (  # one synchronization per phase
        float(torch.stack(losses).double() @ torch.tensor(sizes, dtype=torch.float64)) / samples
        if samples
        else 0.0
    )
    if not math.isfinite(mean_loss):
        msg = f"training loss became {mean_loss}"
        raise TrainingError(msg)
    return TrainStats(steps, samples, mean_loss)


def _optimizer_step(spec: TrainSpec, parameters: Mapping[str, nn.Parameter]) -> Callable[[], None]:
    """One SGD step over `spec.trainable`, with each tensor's step size.

    Plain SGD (no momentum, no weight decay) is `w -= lr * grad`, exactly what torch.optim.SGD
    computes for it; done directly as one fused call per step size, since the optimizer's
    bookkeeping costs more than the arithmetic on the small models of a simulated fleet.
    """
    groups: dict[float, list[nn.Parameter]] = {}
    for name in spec.trainable:
        groups.setdefault(spec.lr_by_name.get(name, spec.lr), []).append(parameters[name])
    if spec.momentum or spec.weight_decay:
        optimizer = torch.optim.SGD(
            [{"params": group, "lr": lr} for lr, group in groups.items()],
            lr=spec.lr,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
        )
        return optimizer.step

    def plain_step() -> None:
        with torch.no_grad():
            for lr, group in groups.items():
                stepped: list[torch.Tensor] = [p for p in group if p.grad is not None]
                if stepped:
                    grads = [p.grad for p in stepped if p.grad is not None]
                    torch._foreach_add_(stepped, grads, alpha=-lr)

    return plain_step


def _set_mode(model: nn.Module, *, training: bool) -> None:
    """`model.train(training)`, skipped when every module is in that mode: it sets each flag."""
    if any(module.training != training for module in model.modules()):
        model.train(training)


def _release_gradients(parameters: Sequence[nn.Parameter]) -> None:
    """Drop gradients (set to None, as `zero_grad` does), so the next backward starts fresh."""
    for parameter in parameters:
        parameter.grad = None


def _accumulate(
    model: Forward,
    task: Task,
    batch_data: tuple[torch.Tensor, torch.Tensor],
    micro: tuple[int | None, int],
    extra_loss: ExtraLoss | None,
) -> torch.Tensor:
    """Backpropagate one batch as micro-batches whose gradients sum to the whole batch's.

    `micro` is (the micro-batch size, None for the whole batch; the fewest rows a micro-batch
    may hold, 2 for BatchNorm: a smaller last one joins the one before it). Returns the batch's
    task loss without synchronizing; non-finite values surface at the end of the phase (loss
    and parameters are checked there).
    """
    inputs, targets = batch_data
    micro_batch_size, least = micro
    batch = int(inputs.shape[0])
    size = batch if micro_batch_size is None else max(least, min(micro_batch_size, batch))
    if size >= batch:
        total = task.loss(model(inputs), targets)
        total.backward()
    else:
        total = torch.zeros(())
        for start, end in chunks(batch, size, least):
            loss = task.loss(model(inputs[start:end]), targets[start:end])
            loss = loss * ((end - start) / batch)
            loss.backward()
            total = total + loss.detach()
    if extra_loss is not None:
        extra_loss().backward()
    return total


def total_norm(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `values` taken together, as float64.

    What `torch.nn.utils.get_total_norm` computes, which only torch 2.6 and newer have, while
    pfl-edge accepts torch 2.1 (a board's own build is often older).
    """
    norms = [torch.linalg.vector_norm(value).to(torch.float64) for value in values]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def require_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse to keep or send non-finite tensors, in one fused pass (a total norm).

    Training checks its loss every phase; this guards what outlives it (personal state on
    disk), since a last step can leave NaN weights behind a finite loss. Shared deltas get the
    same check in the codec before they are sent.

    Raises:
        TrainingError: some tensor holds NaN or Inf.
    """
    values = [t.detach() for t in tensors.values() if t.is_floating_point() and t.numel()]
    if values and not math.isfinite(float(total_norm(values))):
        msg = f"{what} became non-finite during training"
        raise TrainingError(msg)


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, split: Split, batch_size: int = 1024) -> float:
    """The task's metric averaged over `split` (accuracy or mean squared error)."""
    if len(split) == 0:
        return float("nan")
    _set_mode(model, training=False)
    total = 0.0
    for start in range(0, len(split), batch_size):
        outputs = model(split.inputs[start : start + batch_size])
        total += task.metric_sum(outputs, split.targets[start : start + batch_size])
    return total / len(split)


def at_least_as_good(metric_name: str, candidate: float, incumbent: float) -> bool:
    """Whether `candidate` scores no worse than `incumbent` (MSE: lower is better, else higher).

    NaN never wins against a number; an incumbent NaN (e.g. an empty split) keeps the candidate.
    """
    if math.isnan(incumbent):
        return True
    if math.isnan(candidate):
        return False
    return candidate <= incumbent if metric_name == "mse" else candidate >= incumbent


class ModelSlots:
    """Copies named tensors into a model in place, without a state_dict() round trip.

    The hot path of simulation loads weights thousands of times; `load_state_dict` costs several
    times a plain copy for small models.
    """

    def __init__(self, model: nn.Module) -> None:
        self._slots = dict(model.state_dict(keep_vars=True))
        self.parameter_names = frozenset(name for name, _ in model.named_parameters())
        """The names among the slots that are parameters (the rest are buffers)."""

    def live(self) -> Tensors:
        """The model's tensors as they are now, detached (what `state_dict()` would give)."""
        return {name: value.detach() for name, value in self._slots.items()}

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `tensors` into the model's parameters and buffers of the same names.

        Raises:
            ValueError: a name the model does not have, or a shape that differs.
        """
        if not tensors:  # e.g. no personal part: not even a no_grad context
            return
        with torch.no_grad():
            for name, value in tensors.items():
                slot = self._slots.get(name)
                if slot is None or slot.shape != value.shape:
                    expected = "absent" if slot is None else tuple(slot.shape)
                    msg = f"cannot load {name} of shape {tuple(value.shape)} (model: {expected})"
                    raise ValueError(msg)
                slot.copy_(value)


def snapshot(model: nn.Module, names: Sequence[str]) -> Tensors:
    """Detached copies of the named state_dict tensors."""
    state = model.state_dict()
    return {name: state[name].detach().clone() for name in names}


def difference(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> Tensors:
    """`after - before` per tensor: the one sign of every delta (local - global)."""
    return {name: after[name] - before[name] for name in before}


def squared_distance(model: nn.Module, reference: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sum of ||w - reference||^2 over reference's parameters (not buffers), differentiable."""
    parameters = dict(model.named_parameters())
    terms = [
        ((parameters[name] - value) ** 2).sum()
        for name, value in reference.items()
        if name in parameters
    ]
    return torch.stack(terms).sum() if terms else torch.zeros(())
