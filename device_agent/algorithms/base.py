"""The local-update interface: the math of one algorithm's device half, free of I/O."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal, Protocol, TypeVar

import torch
from torch import nn

from device_agent.training import (
    ExtraLoss,
    ModelSlots,
    StepBudget,
    TrainSpec,
    TrainStats,
    combine_stats,
    difference,
    snapshot,
    squared_distance,
    train,
)
from pfl_tasks.base import DeviceData, Task
from pfl_tasks.split import ParamSplit
from protocols.algorithms import AlgorithmConfig, PartialConfig
from protocols.codec import Tensors


@dataclass
class LocalContext:
    """Everything a local update may use; `model` already holds global shared + personal tensors."""

    model: nn.Module
    task: Task
    data: DeviceData
    split: ParamSplit
    config: AlgorithmConfig
    global_shared: Tensors
    personal: Tensors
    generator: torch.Generator
    budget: StepBudget = field(default_factory=StepBudget)
    assignment: Mapping[str, float] = field(default_factory=dict)
    state: Tensors = field(default_factory=dict)
    """Algorithm-owned tensors kept between rounds beside the model's personal part (e.g.
    Self-FL's personal model copy and running variance); empty at first and when stateless."""
    device_id: str = ""
    peers: tuple[str, ...] = ()
    """The model owners a relay algorithm may ask for this round (the announcement's list)."""
    peer_models: Mapping[str, Tensors] = field(default_factory=dict)
    """The owners' models the coordinator relayed for this round (FedeRiCo), by owner."""
    slots: ModelSlots | None = None
    """`model`'s tensors by name, kept by the device across rounds (None: read from `model`)."""


@dataclass(frozen=True)
class LocalResult:
    """What a round produced: the shared delta goes up; `personal` and `state` stay.

    The delta is local - global, one sign everywhere; what stays is persisted when stateful.
    """

    shared_delta: Tensors
    num_samples: int
    train_loss: float
    personal: Tensors
    scalars: dict[str, float] = field(default_factory=dict)
    state: Tensors = field(default_factory=dict)


class LocalUpdate(Protocol):
    """The device half of an algorithm."""

    name: ClassVar[str]

    def run(self, ctx: LocalContext) -> LocalResult:
        """Train locally for one round."""
        ...

    def personalize(self, ctx: LocalContext) -> None:
        """Turn `ctx.model` into the model this device would deploy (e.g. fine-tune it)."""
        ...


@dataclass(frozen=True)
class BatchPhase:
    """One phase of a local update as the batched path runs it (`device_agent.batched`).

    `spec` is what `train_phase` would get; `proximal_mu` (None: no term) adds
    mu/2 ||w - w_global||^2 over the received shared parameters at every step (FedProx), or
    over the phase's trainable parameters toward the whole received model when
    `proximal_to_received` (Ditto's lam/2 ||theta - w^t||^2).
    """

    spec: TrainSpec
    proximal_mu: float | None = None
    proximal_to_received: bool = False
    restart: bool = False
    """The model's parameters start again from the received model (not where the last phase
    left them)."""
    from_state: str | None = None
    """The phase starts from the tensors `ctx.state` keeps under this prefix for each of its
    trainable parameters (from the received model where any is missing)."""
    kept_as: str | None = None
    """The phase's final trainable tensors go into the round's `state` under this prefix."""
    counted: bool = True
    """Whether the phase's loss is part of the round's reported train loss."""


class BatchableUpdate(LocalUpdate, Protocol):
    """A device half whose round is phases of the one training loop from the received model.

    Its `run` trains `batch_phases(ctx)` in order, then reports `round_result` with the
    phases' combined stats; so many devices' rounds may run stacked with the same result.
    """

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """The phases `run` trains, in order."""
        ...


def batch_phases(update: LocalUpdate, ctx: LocalContext) -> tuple[BatchPhase, ...] | None:
    """`update`'s phases if it declares them (None: it trains per device only)."""
    declared = getattr(update, "batch_phases", None)
    return None if declared is None else tuple(declared(ctx))


class RelayUpdate(LocalUpdate, Protocol):
    """A device half that works on models relayed from the coordinator (FedeRiCo)."""

    relays: ClassVar[bool]

    def choose_models(
        self, ctx: LocalContext, phase: Literal["train", "evaluate"]
    ) -> tuple[str, ...]:
        """The owners whose models this round needs, from the device's private state."""
        ...

    def deployable(self, ctx: LocalContext) -> nn.Module:
        """The module this device would deploy, built from `ctx.peer_models`."""
        ...


def is_relay(update: LocalUpdate) -> bool:
    """Whether `update` needs models relayed before it can run."""
    return bool(getattr(update, "relays", False))


def relay_update(update: LocalUpdate) -> RelayUpdate:
    """`update` as a relay algorithm's device half.

    Raises:
        TypeError: the algorithm relays no models.
    """
    if not is_relay(update):
        msg = f"{update.name} relays no models"
        raise TypeError(msg)
    return update  # type: ignore[return-value]


ConfigT = TypeVar("ConfigT", bound=AlgorithmConfig)


def require_config(ctx: LocalContext, config_type: type[ConfigT]) -> ConfigT:
    """`ctx.config`, checked to be the algorithm's own config type.

    Raises:
        TypeError: the config belongs to another algorithm.
    """
    if not isinstance(ctx.config, config_type):
        msg = f"expected {config_type.__name__}, got {type(ctx.config).__name__}"
        raise TypeError(msg)
    return ctx.config


def trainable_parameters(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The names among `names` that are parameters (buffers are carried, not trained)."""
    parameters = dict(model.named_parameters())
    return tuple(name for name in names if name in parameters)


def phase_spec(
    ctx: LocalContext,
    names: tuple[str, ...],
    *,
    epochs: int,
    lr: float,
    max_steps: int | None = None,
    lr_by_name: Mapping[str, float] | None = None,
) -> TrainSpec:
    """A phase training the parameters among `names`, with the config's other settings."""
    cfg = ctx.config
    if ctx.slots is not None:
        trainable = tuple(name for name in names if name in ctx.slots.parameter_names)
    else:
        trainable = trainable_parameters(ctx.model, names)
    return TrainSpec(
        trainable=trainable,
        epochs=epochs,
        batch_size=cfg.batch_size,
        lr=lr,
        max_steps=max_steps,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        clip_grad_norm=cfg.clip_grad_norm,
        lr_by_name=dict(lr_by_name or {}),
    )


def train_phase(
    ctx: LocalContext, spec: TrainSpec, extra_loss: ExtraLoss | None = None
) -> TrainStats:
    """Run one phase of the one training loop on the device's train split."""
    return train(
        ctx.model,
        ctx.task,
        ctx.data.train,
        spec,
        ctx.generator,
        budget=ctx.budget,
        extra_loss=extra_loss,
    )


def round_result(ctx: LocalContext, stats: TrainStats) -> LocalResult:
    """Report the shared delta (local - global) and keep the personal tensors on the device."""
    live = (
        ctx.slots.live()
        if ctx.slots is not None
        else {name: value.detach() for name, value in ctx.model.state_dict(keep_vars=True).items()}
    )
    return LocalResult(
        shared_delta=difference(live, ctx.global_shared),  # global_shared names the shared part
        num_samples=len(ctx.data.train),
        train_loss=stats.mean_loss,
        personal={name: live[name].clone() for name in ctx.split.personal},
    )


def run_phases(ctx: LocalContext, phases: tuple[BatchPhase, ...]) -> LocalResult:
    """Train `phases` in order on one device; the round's result (`BatchableUpdate.run`)."""
    received = {**ctx.global_shared, **ctx.personal}  # what `ctx.model` holds to begin with
    slots = ctx.slots or ModelSlots(ctx.model)
    stats: list[TrainStats] = []
    state: Tensors = {}
    for phase in phases:
        names = phase.spec.trainable
        if phase.restart:
            slots.load({n: received[n] for n in trainable_parameters(ctx.model, tuple(received))})
        if phase.from_state is not None:
            kept = [phase.from_state + name for name in names]
            if all(key in ctx.state for key in kept):
                slots.load({name: ctx.state[key] for name, key in zip(names, kept, strict=True)})
            else:
                slots.load({name: received[name] for name in names})
        reference = {n: received[n] for n in names} if phase.proximal_to_received else None
        trained = train_phase(ctx, phase.spec, proximal_loss(ctx, phase.proximal_mu, reference))
        if phase.counted:
            stats.append(trained)
        if phase.kept_as is not None:
            live = snapshot(ctx.model, names)
            state.update({phase.kept_as + name: value for name, value in live.items()})
    result = round_result(ctx, stats[0] if len(stats) == 1 else combine_stats(*stats))
    return replace(result, state=state) if state else result


def proximal_loss(
    ctx: LocalContext, mu: float | None, reference: Tensors | None = None
) -> ExtraLoss | None:
    """mu/2 ||w - reference||^2, by default over the received shared parameters (None: no term)."""
    if mu is None:
        return None
    pulled_to = ctx.global_shared if reference is None else reference
    return lambda: 0.5 * mu * squared_distance(ctx.model, pulled_to)


def full_model_spec(ctx: LocalContext) -> TrainSpec:
    """Local SGD on every parameter, shared and personal, as the config says."""
    cfg = ctx.config
    return phase_spec(
        ctx,
        ctx.split.shared + ctx.split.personal,
        epochs=cfg.local_epochs,
        lr=cfg.lr,
        max_steps=cfg.max_steps,
    )


def train_whole_model(ctx: LocalContext, extra_loss: ExtraLoss | None = None) -> LocalResult:
    """One round of local SGD on the whole model; report the shared delta and keep the rest."""
    return round_result(ctx, train_phase(ctx, full_model_spec(ctx), extra_loss))


class PhasedUpdate(ABC):
    """A `BatchableUpdate` whose round is nothing but its phases: `run` trains `batch_phases`.

    So the per-device round and the batched one cannot drift apart.
    """

    name: ClassVar[str]

    def run(self, ctx: LocalContext) -> LocalResult:
        """One round: the phases in order, then the shared delta goes up."""
        return run_phases(ctx, self.batch_phases(ctx))

    @abstractmethod
    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """The phases `run` trains, in order."""

    @abstractmethod
    def personalize(self, ctx: LocalContext) -> None:
        """Turn `ctx.model` into the model this device would deploy."""


class WholeModelUpdate(PhasedUpdate):
    """FedAvg's round: one phase of local SGD on every parameter from the received model."""

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """One phase on the whole model."""
        return (BatchPhase(full_model_spec(ctx)),)


def finetune_personal(ctx: LocalContext, cfg: PartialConfig) -> None:
    """Stage c (spec §3.1(c), §2.4): train only the personal part, shared frozen.

    `finetune_epochs` passes at `finetune_lr` (None = gamma_v); 0 epochs leaves the model as is.
    """
    spec = phase_spec(
        ctx, ctx.split.personal, epochs=cfg.finetune_epochs, lr=cfg.finetune_step_size()
    )
    train_phase(ctx, spec)
