"""The round engine's seams: what an uplink collected, and the stages a round passes through.

The engine runs one round: cohort -> plan -> announce -> uplink.collect -> stages -> aggregate ->
finish. What differs between features sits behind two seams, each with a null object (the plain
uplink; a `StageChain` of no stages), so the engine holds no feature branches; a scheduler
(`coordinator.engine.rounds.Schedule`) may supply the round's collection:

- an uplink path (`coordinator.stages.uplink`) collects a round's updates: plain ones, or a
  secure sum (`coordinator.stages.secure.uplink`), or a buffer a scheduler filled; it returns a
  `Collected` or, when a round released nothing, a `Skipped`;
- round stages (`RoundStage`; differential privacy's is `coordinator.stages.privacy_stage`) see
  the round before and after the collection and may transform its updates and scalars. Each has
  a JSON `state()` a checkpoint keeps and `load_state()` a resumed run restores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from coordinator.strategies.base import FleetSnapshot, ReceivedUpdate
from protocols.messages import DevicePrivacy, SecureRound


@dataclass(frozen=True)
class Collected:
    """The updates a round's uplink brought in, and what the round record says of them."""

    updates: list[ReceivedUpdate]
    participants: int
    """Devices whose work is in `updates` (a presummed update stands for many)."""
    selected: int
    within_clip: list[float | None] = field(default_factory=list)
    """Each reporter's noised within-clip bit, or (presummed) their sum."""
    declined: int = 0
    presummed: bool = False
    """One update holds the sum of the devices' deltas (secure aggregation)."""
    reports_norm: bool = True
    """Whether the median update norm may be shown (not of a masked sum)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """The uplink's own scalars for the round record."""
    sim_seconds: float | None = None
    """On a simulated clock: when the round's collection ended."""


@dataclass(frozen=True)
class Skipped:
    """A round that released nothing: the model stays as it was."""

    selected: int
    population: int
    """Devices online when the round was drawn."""
    unmasked: int
    """Devices in a sum that was seen and refused (0: none was seen)."""
    scalars: dict[str, float] = field(default_factory=dict)
    sim_seconds: float | None = None


class RoundStage(Protocol):
    """A cross-cutting stage of every round; a `StageChain` of none is the null one."""

    name: str
    """Its key in a checkpoint's stage states."""

    def cohort(self, fleet: FleetSnapshot, rng: np.random.Generator) -> FleetSnapshot:
        """The fleet a round's strategy plans on."""
        ...

    def releases_empty(self, fleet: FleetSnapshot) -> bool:
        """Whether a round that drew nobody from `fleet` still runs."""
        ...

    def device_privacy(self, fleet: FleetSnapshot, selected: Sequence[str]) -> DevicePrivacy | None:
        """What the announcement tells the selected devices to do to their updates."""
        ...

    def aggregation(self, buffer: int) -> DevicePrivacy | None:
        """What the devices asked for the next asynchronous aggregation (`buffer` updates) are told.

        Its devices are chosen by their timing, not drawn: a buffered scheduler says so when it
        starts, and before each aggregation.
        """
        ...

    def dealt(self, secure: SecureRound, dimension: int) -> None:
        """A secure round was planned on this grid, for `dimension` coordinates."""
        ...

    def transform(
        self, updates: list[ReceivedUpdate], shared: Mapping[str, torch.Tensor], presummed: bool
    ) -> list[ReceivedUpdate]:
        """The round's updates as the strategy may see them."""
        ...

    def release(self, collected: Collected, scalars: dict[str, float]) -> None:
        """The round was aggregated: account for it, adjust its `scalars` in place."""
        ...

    def skipped(self, skipped: Skipped) -> dict[str, float]:
        """The round released nothing: what it cost; its scalars."""
        ...

    def train_loss(self, loss: float) -> float:
        """The round's train loss as it may be shown."""
        ...

    def state(self) -> dict[str, Any]:
        """What a resumed run needs (JSON)."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `state()`'s output.

        Raises:
            ValueError: not this stage's state.
        """
        ...


class StageChain:
    """A run's stages as one, each hook asking them in order.

    Of no stages it is the null stage: every hook leaves the round as it is.
    """

    name = "chain"

    def __init__(self, stages: Sequence[RoundStage]) -> None:
        self.stages = tuple(stages)

    def cohort(self, fleet: FleetSnapshot, rng: np.random.Generator) -> FleetSnapshot:
        """See `RoundStage.cohort`: each stage narrows the last one's."""
        for stage in self.stages:
            fleet = stage.cohort(fleet, rng)
        return fleet

    def releases_empty(self, fleet: FleetSnapshot) -> bool:
        """See `RoundStage.releases_empty`: whether any stage releases an empty round."""
        return any(stage.releases_empty(fleet) for stage in self.stages)

    def device_privacy(self, fleet: FleetSnapshot, selected: Sequence[str]) -> DevicePrivacy | None:
        """See `RoundStage.device_privacy`: the first stage's that has any."""
        told = [stage.device_privacy(fleet, selected) for stage in self.stages]
        return next((t for t in told if t is not None), None)

    def aggregation(self, buffer: int) -> DevicePrivacy | None:
        """See `RoundStage.aggregation`: the first stage's that has any."""
        told = [stage.aggregation(buffer) for stage in self.stages]
        return next((t for t in told if t is not None), None)

    def dealt(self, secure: SecureRound, dimension: int) -> None:
        """See `RoundStage.dealt`."""
        for stage in self.stages:
            stage.dealt(secure, dimension)

    def transform(
        self, updates: list[ReceivedUpdate], shared: Mapping[str, torch.Tensor], presummed: bool
    ) -> list[ReceivedUpdate]:
        """See `RoundStage.transform`: each stage transforms the last one's output."""
        for stage in self.stages:
            updates = stage.transform(updates, shared, presummed)
        return updates

    def release(self, collected: Collected, scalars: dict[str, float]) -> None:
        """See `RoundStage.release`."""
        for stage in self.stages:
            stage.release(collected, scalars)

    def skipped(self, skipped: Skipped) -> dict[str, float]:
        """See `RoundStage.skipped`."""
        scalars: dict[str, float] = {}
        for stage in self.stages:
            scalars.update(stage.skipped(skipped))
        return scalars

    def train_loss(self, loss: float) -> float:
        """See `RoundStage.train_loss`."""
        for stage in self.stages:
            loss = stage.train_loss(loss)
        return loss

    def state(self) -> dict[str, Any]:
        """Each stage's state under its name (a checkpoint's `stages`)."""
        return {stage.name: stage.state() for stage in self.stages}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Each stage's state from `state()`'s output.

        Raises:
            ValueError: a stage of this run has no state there, or one it cannot read.
        """
        for stage in self.stages:
            if stage.name not in state:
                msg = f"the checkpoint holds no {stage.name} state: it cannot resume this run"
                raise ValueError(msg)
            try:
                stage.load_state(state[stage.name])
            except ValueError as error:
                msg = f"the checkpoint's {stage.name} state: {error}"
                raise ValueError(msg) from error
