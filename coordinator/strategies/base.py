"""The strategy interface: an algorithm's coordinator half, pure and synchronous.

A strategy picks devices and aggregates their updates. It never waits, publishes or reads the
clock; `coordinator.engine.rounds` owns deadlines, quorum, stale rounds and checkpoint timing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from protocols.algorithms import AlgorithmConfig
from protocols.codec import Tensors
from protocols.messages import PeerRequest, RelayedModel, TensorSpec


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
    within_clip: float | None = None
    """Under DP's adaptive clipping: the device's noised bit (see protocols.privacy)."""


@dataclass(frozen=True)
class Aggregate:
    """The new shared tensors and the fleet scalars a round produced."""

    shared: Tensors
    scalars: Mapping[str, float] = field(default_factory=dict)


class Strategy(Protocol):
    """The coordinator half of an algorithm."""

    name: ClassVar[str]
    config_type: ClassVar[type[AlgorithmConfig]]

    @property
    def config(self) -> AlgorithmConfig:
        """The algorithm's typed configuration (each strategy narrows it to its own)."""
        ...

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


ModelBuilder = Callable[[int], Tensors]
"""The task's fresh model tensors for a seed (what `task.build_model(seed)` holds)."""


@dataclass(frozen=True)
class Relay:
    """What a relay strategy answers a PeerRequest with.

    `tensors` holds the sent models as `<owner>/<name>`; `expected` is the layout of the update
    the device may send back (a contribution per model it now holds), empty for evaluation.
    """

    models: tuple[RelayedModel, ...]
    missing: tuple[str, ...]
    tensors: Tensors
    expected: tuple[TensorSpec, ...] = ()


@runtime_checkable
class RelayStrategy(Strategy, Protocol):
    """A strategy that keeps one model per device and relays them on request (FedeRiCo).

    The engine asks it for the candidate owners to announce, hands it each device's request,
    and validates each update against the layout its relay promised.
    """

    def bind(self, template: Tensors, build_model: ModelBuilder | None, seed: int) -> None:
        """Learn the model layout, how to initialize a device's model, and the run seed."""
        ...

    def candidates(self, fleet: FleetSnapshot) -> tuple[str, ...]:
        """The owners devices may sample this round."""
        ...

    def relay(self, round_id: int, request: PeerRequest) -> Relay:
        """The models `request` asks for (only those the device does not already hold).

        Raises:
            RoundError: the request breaks the algorithm's rules (too many peers, ...).
        """
        ...

    def state_tensors(self) -> Tensors:
        """The tensors a checkpoint must hold (models, optimizer moments)."""
        ...

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore from `state_tensors()`'s output (after `load_state_dict`)."""
        ...


def relaying(strategy: Strategy) -> RelayStrategy | None:
    """`strategy` as a relay when its config declares it relays models (`relays_models`).

    Raises:
        TypeError: the config declares relayed models and the strategy has no relay to offer.
    """
    if not strategy.config.capabilities.relays_models:
        return None
    if not isinstance(strategy, RelayStrategy):
        msg = f"{strategy.name} declares that it relays models but its strategy cannot relay"
        raise TypeError(msg)
    return strategy
