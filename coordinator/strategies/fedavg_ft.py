"""FedAvg + fine-tuning, coordinator half: FedAvg itself; the fine-tuning happens on devices."""

from __future__ import annotations

from typing import ClassVar

from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import AlgorithmConfig, FedAvgFtConfig


class FedAvgFtStrategy(FedAvgStrategy):
    """Aggregates exactly as FedAvg."""

    name: ClassVar[str] = "fedavg-ft"
    config_type: ClassVar[type[AlgorithmConfig]] = FedAvgFtConfig
