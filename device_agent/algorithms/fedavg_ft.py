"""FedAvg + local fine-tuning: FedAvg in training, then each device adapts the final model."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    phase_spec,
    require_config,
    train_phase,
    train_whole_model,
)
from protocols.algorithms import FedAvgFtConfig


class FedAvgFtUpdate:
    """Trains as FedAvg; `personalize` fine-tunes the global model on the device's train split."""

    name: ClassVar[str] = "fedavg-ft"

    def run(self, ctx: LocalContext) -> LocalResult:
        """One FedAvg round."""
        return train_whole_model(ctx)

    def personalize(self, ctx: LocalContext) -> None:
        """Fine-tune every parameter for `finetune_epochs` at `finetune_lr`.

        With the round's other settings (momentum, weight decay, clipping), as every phase.
        """
        cfg = require_config(ctx, FedAvgFtConfig)
        if cfg.finetune_epochs == 0:
            return
        names = ctx.split.shared + ctx.split.personal
        train_phase(ctx, phase_spec(ctx, names, epochs=cfg.finetune_epochs, lr=cfg.finetune_lr))
