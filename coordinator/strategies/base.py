"""The strategy interface: an algorithm's coordinator half, pure and synchronous.

A strategy picks devices and aggregates their updates. It never waits, publishes or reads the
clock; `coordinator.rounds` owns deadlines, quorum, stale rounds and checkpoint timing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import torch

from protocols.algorithms import AlgorithmConfig

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DeviceInfo:
    """What the coordinator knows of one device when planning."""

    device_id: str
    num_train_samples: int
    online: bool


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet as the registry sees it at planning time, sorted by device id."""

    devices: tuple[DeviceInfo, ...]

    def online(self) -> list[str]:
        """Ids of the devices that can take part now."""
        return [device.device_id for device in self.devices if device.online]


@dataclass(frozen=True)
class RoundPlan:
    """Who trains this round and what each receives beyond the shared model."""

    devices: tuple[str, ...]
    scalars: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReceivedUpdate:
    """A decoded, validated device update."""

    device_id: str
    num_samples: int
    train_loss: float
    shared_delta: Tensors
    scalars: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Aggregate:
    """The new shared tensors and the fleet scalars a round produced."""

    shared: Tensors
    scalars: Mapping[str, float] = field(default_factory=dict)


class Strategy(Protocol):
    """The coordinator half of an algorithm."""

    name: ClassVar[str]
    config_type: ClassVar[type[AlgorithmConfig]]
    config: AlgorithmConfig

    def __init__(self, config: AlgorithmConfig, participation: float) -> None: ...

    def plan_round(
        self, round_id: int, fleet: FleetSnapshot, rng: np.random.Generator
    ) -> RoundPlan:
        """Choose this round's devices (and their per-device scalars)."""
        ...

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Combine the round's updates (sorted by device id) into new shared tensors."""
        ...

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint must hold to resume this strategy."""
        ...

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from `state_dict()`'s output."""
        ...
