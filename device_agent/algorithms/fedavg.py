"""FedAvg, device half: local SGD from the global model, report the shared delta."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    LocalResult,
    train_whole_model,
    whole_model_phases,
)


class FedAvgUpdate:
    """Local SGD for `local_epochs` (or `max_steps`) from the received global model."""

    name: ClassVar[str] = "fedavg"

    def run(self, ctx: LocalContext) -> LocalResult:
        """Train every parameter; the shared part's delta goes up."""
        return train_whole_model(ctx)

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """One phase on the whole model (what `run` trains)."""
        return whole_model_phases(ctx)

    def personalize(self, ctx: LocalContext) -> None:
        """FedAvg deploys the global model as it is."""
        del ctx
