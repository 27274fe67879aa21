"""pFedBreD and pFedMe, coordinator half: n_i-weighted mean delta mixed in by beta."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch

from coordinator.engine.selection import select_devices
from coordinator.strategies.aggregate import apply_delta, weighted_mean
from coordinator.strategies.base import (
    Aggregate,
    FleetSnapshot,
    ReceivedUpdate,
    RoundPlan,
)
from protocols.algorithms import AlgorithmConfig, PFedBreDConfig, PFedMeConfig, ProximalPriorConfig
from protocols.codec import Tensors


def aggregate_momentum(
    shared: Mapping[str, torch.Tensor], mean_delta: Mapping[str, torch.Tensor], beta: float
) -> Tensors:
    """w^(t) = (1 - beta) w^(t-1) + beta w_bar = w^(t-1) + beta sum_i p_i Delta_i.

    Spec §2.3 ("aggregate momentum"; beta = 1 is the weighted average, beta = 2 is "+AM").
    """
    return apply_delta(shared, mean_delta, beta)


class PFedBreDStrategy:
    """Samples devices uniformly, weighs their deltas by n_i, mixes with beta (spec §2.3, §6 A7).

    With `train_all_clients` every online device trains (keeping every theta fresh, as the
    official code) and only the sampled ones are aggregated (§6 A6).
    """

    name: ClassVar[str] = "pfedbred"
    config_type: ClassVar[type[AlgorithmConfig]] = PFedBreDConfig

    def __init__(self, config: AlgorithmConfig, participation: float) -> None:
        if not isinstance(config, self.config_type) or not isinstance(config, ProximalPriorConfig):
            msg = f"{self.name} needs {self.config_type.__name__}, got {type(config).__name__}"
            raise TypeError(msg)
        self.config: AlgorithmConfig = config
        self._settings: ProximalPriorConfig = config
        self.participation = participation
        self._aggregated: tuple[str, ...] | None = None

    def plan_round(
        self, round_id: int, fleet: FleetSnapshot, rng: np.random.Generator
    ) -> RoundPlan:
        """A uniform sample without replacement (or everyone, aggregating the sample)."""
        del round_id
        online = fleet.online()
        sampled = select_devices(online, self.participation, rng)
        if not self._settings.train_all_clients:
            self._aggregated = None
            return RoundPlan(sampled)
        self._aggregated = sampled
        return RoundPlan(tuple(sorted(online)))

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Mix in the aggregated reporters: w + beta * sum_i n_i Delta_i / sum_i n_i."""
        del round_id
        kept = [u for u in updates if self._aggregated is None or u.device_id in self._aggregated]
        if not shared or not kept:
            return Aggregate(dict(shared))
        mean = weighted_mean([u.shared_delta for u in kept], [float(u.num_samples) for u in kept])
        return Aggregate(aggregate_momentum(shared, mean, self._settings.beta))

    def state_dict(self) -> dict[str, object]:
        """The sample the current round aggregates (when every device trains)."""
        return {"aggregated": None if self._aggregated is None else list(self._aggregated)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the current round's aggregated sample."""
        aggregated = state.get("aggregated")
        self._aggregated = (
            tuple(str(d) for d in aggregated) if isinstance(aggregated, list) else None
        )


class PFedMeStrategy(PFedBreDStrategy):
    """pFedMe's server step is pFedBreD's (spec §5)."""

    name: ClassVar[str] = "pfedme"
    config_type: ClassVar[type[AlgorithmConfig]] = PFedMeConfig
