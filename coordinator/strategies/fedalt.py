"""FedAlt, coordinator half: FedAvg's outer loop over the shared part only (spec §1.2)."""

from __future__ import annotations

from typing import ClassVar

from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import AlgorithmConfig, FedAltConfig


class FedAltStrategy(FedAvgStrategy):
    """Samples and aggregates as FedAvg/FedAdam; personal parameters never reach the server.

    Spec §1.2: m devices uniformly without replacement, u(t+1) from the alpha-weighted mean of
    the reported shared deltas (renormalized over the reporters), then the server optimizer
    (§1.5). The alternating local update lives on the device (`device_agent.algorithms.fedalt`).
    """

    name: ClassVar[str] = "fedalt"
    config_type: ClassVar[type[AlgorithmConfig]] = FedAltConfig
