"""FedAvg + local fine-tuning: FedAvg in training, then each device adapts the final model."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    LocalContext,
    WholeModelUpdate,
    phase_spec,
    require_config,
    train_phase,
)
from device_agent.training import ModelSlots, at_least_as_good, evaluate, snapshot
from protocols.algorithms import FedAvgFtConfig


class FedAvgFtUpdate(WholeModelUpdate):
    """Trains as FedAvg; `personalize` fine-tunes the global model on the device's train split."""

    name: ClassVar[str] = "fedavg-ft"

    def personalize(self, ctx: LocalContext) -> None:
        """Fine-tune every parameter for `finetune_epochs` at `finetune_lr`.

        With the round's other settings (momentum, weight decay, clipping), as every phase.
        A few samples can make fine-tuning hurt a device (an undertrained global model, labels
        unlike the device's test data): with `finetune_select` the device keeps the global
        model where that scores better on its own validation split.
        """
        cfg = require_config(ctx, FedAvgFtConfig)
        if cfg.finetune_epochs == 0:
            return
        names = ctx.split.shared + ctx.split.personal
        start = snapshot(ctx.model, names)
        before = evaluate(ctx.model, ctx.task, ctx.data.val) if cfg.finetune_select else None
        train_phase(ctx, phase_spec(ctx, names, epochs=cfg.finetune_epochs, lr=cfg.finetune_lr))
        if before is not None:
            after = evaluate(ctx.model, ctx.task, ctx.data.val)
            if not at_least_as_good(ctx.task.metric_name, after, before):
                ModelSlots(ctx.model).load(start)
