"""The base of strategies whose rounds train a uniform sample of the online devices."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from coordinator.engine.selection import select_devices
from coordinator.strategies.base import Aggregate, FleetSnapshot, ReceivedUpdate, RoundPlan
from protocols.algorithms import AlgorithmConfig
from protocols.codec import Tensors


class SampledStrategy(ABC):
    """Checks its config, samples `participation` of the online devices, keeps no state.

    A subclass names its algorithm and config type and says how it aggregates; one that keeps
    state (a server optimizer) overrides `state_dict` and `load_state_dict`.
    """

    name: ClassVar[str]
    config_type: ClassVar[type[AlgorithmConfig]]

    def __init__(self, config: AlgorithmConfig, participation: float) -> None:
        if not isinstance(config, self.config_type):
            msg = f"{self.name} needs {self.config_type.__name__}, got {type(config).__name__}"
            raise TypeError(msg)
        self.config = config
        self.participation = participation

    def plan_round(
        self, round_id: int, fleet: FleetSnapshot, rng: np.random.Generator
    ) -> RoundPlan:
        """A uniform sample of the online devices."""
        del round_id
        return RoundPlan(select_devices(fleet.online(), self.participation, rng))

    @abstractmethod
    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Combine the round's updates (sorted by device id) into new shared tensors."""

    def state_dict(self) -> dict[str, object]:
        """Nothing to checkpoint."""
        return {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Nothing to restore."""
        del state
