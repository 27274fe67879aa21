"""FedProx, coordinator half: FedAvg's aggregation; the proximal term lives on devices."""

from __future__ import annotations

from typing import ClassVar

from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import AlgorithmConfig, FedProxConfig


class FedProxStrategy(FedAvgStrategy):
    """Aggregates exactly as FedAvg (Li et al. 2020, Algorithm 2)."""

    name: ClassVar[str] = "fedprox"
    config_type: ClassVar[type[AlgorithmConfig]] = FedProxConfig
