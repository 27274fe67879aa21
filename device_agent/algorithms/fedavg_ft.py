"""FedAvg + local fine-tuning: FedAvg in training, then each device adapts the final model."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    train_whole_model,
    trainable_parameters,
)
from device_agent.training import TrainSpec, train
from protocols.algorithms import FedAvgFtConfig


class FedAvgFtUpdate:
    """Trains as FedAvg; `personalize` fine-tunes the global model on the device's train split."""

    name: ClassVar[str] = "fedavg-ft"

    def run(self, ctx: LocalContext) -> LocalResult:
        """One FedAvg round."""
        return train_whole_model(ctx)

    def personalize(self, ctx: LocalContext) -> None:
        """Fine-tune every parameter for `finetune_epochs` at `finetune_lr`."""
        cfg = ctx.config
        if not isinstance(cfg, FedAvgFtConfig):
            msg = f"fedavg-ft needs FedAvgFtConfig, got {type(cfg).__name__}"
            raise TypeError(msg)
        if cfg.finetune_epochs == 0:
            return
        spec = TrainSpec(
            trainable=trainable_parameters(ctx.model, ctx.split.shared + ctx.split.personal),
            epochs=cfg.finetune_epochs,
            batch_size=cfg.batch_size,
            lr=cfg.finetune_lr,
            clip_grad_norm=cfg.clip_grad_norm,
        )
        train(ctx.model, ctx.task, ctx.data.train, spec, ctx.generator, budget=ctx.budget)
