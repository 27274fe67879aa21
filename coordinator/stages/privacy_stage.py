"""Differential privacy as a round stage: the engine's seam around `PrivacyEngine`.

Before a round it draws the cohort (a Poisson sample, or the fleet within DP-FTRL's limits) and
tells the selected devices their clip and noise; after the collection it privatizes the updates,
accounts for the released round and adapts the clip. Its rules for what a round may show (no
device's loss, no median update norm) are here, not in the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from coordinator.stages.base import Collected, Skipped
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.secure.retry import account_skipped
from coordinator.strategies.base import FleetSnapshot, ReceivedUpdate
from protocols.messages import DevicePrivacy, SecureRound

WITHHELD = ("update_norm_median",)
"""Round scalars DP does not release: the norms of the devices' updates, before the noise."""


class PrivacyStage:
    """The run's differential privacy (`engine`), as the round engine sees it."""

    name = "privacy"

    def __init__(self, engine: PrivacyEngine) -> None:
        self.engine = engine

    def cohort(self, fleet: FleetSnapshot, rng: np.random.Generator) -> FleetSnapshot:
        """See `RoundStage.cohort`: `PrivacyEngine.cohort`."""
        return self.engine.cohort(fleet, rng)

    def releases_empty(self, fleet: FleetSnapshot) -> bool:
        """See `RoundStage.releases_empty`: an empty Poisson draw releases the noise alone."""
        return self.engine.releases_empty(fleet)

    def device_privacy(self, fleet: FleetSnapshot, selected: Sequence[str]) -> DevicePrivacy | None:
        """See `RoundStage.device_privacy`: the round's clip and noise (`PrivacyEngine.plan`)."""
        return self.engine.plan(fleet, selected)

    def aggregation(self, buffer: int) -> DevicePrivacy | None:
        """See `RoundStage.aggregation`: unsampled, its sum over `buffer` (`plan_aggregation`)."""
        return self.engine.plan_aggregation(buffer)

    def dealt(self, secure: SecureRound, dimension: int) -> None:
        """See `RoundStage.dealt`: the grid a discrete Gaussian is counted on."""
        self.engine.ring(secure, dimension)

    def transform(
        self, updates: list[ReceivedUpdate], shared: Mapping[str, torch.Tensor], presummed: bool
    ) -> list[ReceivedUpdate]:
        """See `RoundStage.transform`: clipped, noised and scaled (`PrivacyEngine.privatize`)."""
        return self.engine.privatize(updates, shared, presummed=presummed)

    def release(self, collected: Collected, scalars: dict[str, float]) -> None:
        """See `RoundStage.release`: the round accounted, the clip adapted.

        Even a round the guard rejected is accounted: its noise was drawn.
        """
        for name in WITHHELD:
            scalars.pop(name, None)
        scalars.update(self.engine.finish(collected.within_clip, reporters=collected.participants))

    def skipped(self, skipped: Skipped) -> dict[str, float]:
        """See `RoundStage.skipped`: a round drawn is counted (`account_skipped`)."""
        return account_skipped(self.engine, skipped, skipped.population, skipped.selected)

    def train_loss(self, loss: float) -> float:
        """See `RoundStage.train_loss`: devices do not report it under DP."""
        return math.nan

    def state(self) -> dict[str, Any]:
        """See `RoundStage.state`: `PrivacyEngine.state_dict`."""
        return self.engine.state_dict()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """See `RoundStage.load_state`: `PrivacyEngine.load_state_dict`."""
        self.engine.load_state_dict(state)
