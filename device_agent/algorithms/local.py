"""Local-only training: each device trains its own model and shares nothing (a baseline)."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    LocalResult,
    train_whole_model,
    whole_model_phases,
)


class LocalOnlyUpdate:
    """Every tensor is personal, so the shared delta is empty and only scalars go up."""

    name: ClassVar[str] = "local"

    def run(self, ctx: LocalContext) -> LocalResult:
        """Keep training the device's own model."""
        return train_whole_model(ctx)

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """One phase on the whole model (what `run` trains)."""
        return whole_model_phases(ctx)

    def personalize(self, ctx: LocalContext) -> None:
        """The device's own model is the deployed one."""
        del ctx
