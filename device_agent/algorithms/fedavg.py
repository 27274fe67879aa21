"""FedAvg, device half: local SGD from the global model, report the shared delta."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import LocalContext, WholeModelUpdate


class FedAvgUpdate(WholeModelUpdate):
    """Local SGD for `local_epochs` (or `max_steps`) from the received global model."""

    name: ClassVar[str] = "fedavg"

    def personalize(self, ctx: LocalContext) -> None:
        """FedAvg deploys the global model as it is."""
        del ctx
