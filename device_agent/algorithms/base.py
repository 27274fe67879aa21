"""The local-update interface: the math of one algorithm's device half, free of I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import nn

from device_agent.training import (
    ExtraLoss,
    StepBudget,
    Tensors,
    TrainSpec,
    difference,
    snapshot,
    train,
)
from protocols.algorithms import AlgorithmConfig
from tasks.base import DeviceData, Task
from tasks.split import ParamSplit


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


@dataclass(frozen=True)
class LocalResult:
    """What a round produced: the shared delta (local - global) goes up, `personal` stays."""

    shared_delta: Tensors
    num_samples: int
    train_loss: float
    personal: Tensors
    scalars: dict[str, float] = field(default_factory=dict)


class LocalUpdate(Protocol):
    """The device half of an algorithm."""

    name: ClassVar[str]

    def run(self, ctx: LocalContext) -> LocalResult:
        """Train locally for one round."""
        ...

    def personalize(self, ctx: LocalContext) -> None:
        """Turn `ctx.model` into the model this device would deploy (e.g. fine-tune it)."""
        ...


def trainable_parameters(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The names among `names` that are parameters (buffers are carried, not trained)."""
    parameters = dict(model.named_parameters())
    return tuple(name for name in names if name in parameters)


def full_model_spec(ctx: LocalContext) -> TrainSpec:
    """Local SGD on every parameter, shared and personal, as the config says."""
    cfg = ctx.config
    return TrainSpec(
        trainable=trainable_parameters(ctx.model, ctx.split.shared + ctx.split.personal),
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        max_steps=cfg.max_steps,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        clip_grad_norm=cfg.clip_grad_norm,
    )


def train_whole_model(ctx: LocalContext, extra_loss: ExtraLoss | None = None) -> LocalResult:
    """One round of local SGD on the whole model; report the shared delta and keep the rest."""
    stats = train(
        ctx.model,
        ctx.task,
        ctx.data.train,
        full_model_spec(ctx),
        ctx.generator,
        budget=ctx.budget,
        extra_loss=extra_loss,
    )
    shared_after = snapshot(ctx.model, ctx.split.shared)
    return LocalResult(
        shared_delta=difference(shared_after, ctx.global_shared),
        num_samples=len(ctx.data.train),
        train_loss=stats.mean_loss,
        personal=snapshot(ctx.model, ctx.split.personal),
    )
