"""FedSim, coordinator half: the same outer loop as FedAlt (spec §1.2)."""

from __future__ import annotations

from typing import ClassVar

from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import AlgorithmConfig, FedSimConfig


class FedSimStrategy(FedAvgStrategy):
    """Samples and aggregates as FedAlt; only the device update differs (spec §1.4)."""

    name: ClassVar[str] = "fedsim"
    config_type: ClassVar[type[AlgorithmConfig]] = FedSimConfig
