"""Ditto, coordinator half: FedAvg's aggregation; the personal models live on devices."""

from __future__ import annotations

from typing import ClassVar

from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import AlgorithmConfig, DittoConfig


class DittoStrategy(FedAvgStrategy):
    """Aggregates exactly as FedAvg (Li et al. 2021, Algorithm 1)."""

    name: ClassVar[str] = "ditto"
    config_type: ClassVar[type[AlgorithmConfig]] = DittoConfig
