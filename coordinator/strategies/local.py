"""Local-only baseline, coordinator half: schedules rounds, aggregates nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from coordinator.strategies.base import Aggregate, ReceivedUpdate
from coordinator.strategies.sampled import SampledStrategy
from protocols.algorithms import AlgorithmConfig, LocalConfig
from protocols.codec import Tensors


class LocalStrategy(SampledStrategy):
    """Devices train their own models; there is no shared part to average."""

    name: ClassVar[str] = "local"
    config_type: ClassVar[type[AlgorithmConfig]] = LocalConfig

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """The shared part (empty unless overridden) stays as it is."""
        del round_id, updates
        return Aggregate(dict(shared))
