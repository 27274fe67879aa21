"""Local-only training: each device trains its own model and shares nothing (a baseline)."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import LocalContext, WholeModelUpdate


class LocalOnlyUpdate(WholeModelUpdate):
    """Every tensor is personal, so the shared delta is empty and only scalars go up.

    The round is FedAvg's: it keeps training the device's own model.
    """

    name: ClassVar[str] = "local"

    def personalize(self, ctx: LocalContext) -> None:
        """The device's own model is the deployed one."""
        del ctx
