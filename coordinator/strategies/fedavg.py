"""FedAvg, coordinator half: sample-weighted mean of shared deltas, then a server step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from coordinator.aggregate import apply_delta, weighted_mean
from coordinator.selection import select_devices
from coordinator.strategies.base import (
    Aggregate,
    FleetSnapshot,
    ReceivedUpdate,
    RoundPlan,
    Tensors,
)
from protocols.algorithms import AlgorithmConfig, FedAvgConfig


class FedAvgStrategy:
    """u <- u + server_lr * sum_i n_i delta_i / sum_i n_i over the round's devices."""

    name: ClassVar[str] = "fedavg"
    config_type: ClassVar[type[AlgorithmConfig]] = FedAvgConfig

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

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Sample-weighted mean of the deltas, applied with `server_lr`."""
        del round_id
        if not shared:
            return Aggregate(dict(shared))
        mean = weighted_mean([u.shared_delta for u in updates], [u.num_samples for u in updates])
        server_lr = self.config.server_lr if isinstance(self.config, FedAvgConfig) else 1.0
        return Aggregate(apply_delta(shared, mean, server_lr))

    def state_dict(self) -> dict[str, object]:
        """FedAvg keeps no state between rounds."""
        return {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Nothing to restore."""
        del state
