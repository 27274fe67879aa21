"""FedAvg, coordinator half: weighted mean of shared deltas, then a server optimizer step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

import torch

from coordinator.strategies.aggregate import robust_combine
from coordinator.strategies.base import Aggregate, ReceivedUpdate
from coordinator.strategies.sampled import SampledStrategy
from coordinator.strategies.server_optimizer import ServerOptimizer, build_server_optimizer
from protocols.algorithms import AlgorithmConfig, FedAvgConfig
from protocols.codec import Tensors

CENTER: Final = "robust_center"
"""The state_dict key of centered clipping's history."""


class FedAvgStrategy(SampledStrategy):
    """u <- u + server_lr * sum_i n_i delta_i / sum_i n_i over the round's devices.

    That is the default; `aggregation_weights="uniform"` weights devices equally and
    `server_optimizer="fedadam"` replaces the SGD step with Adam (spec §1.2, §1.5), and
    `clip_update_norm` / `robust_aggregation` bound what one poisoned update can do.
    """

    name: ClassVar[str] = "fedavg"
    config_type: ClassVar[type[AlgorithmConfig]] = FedAvgConfig

    def __init__(self, config: AlgorithmConfig, participation: float) -> None:
        super().__init__(config, participation)
        if not isinstance(config, FedAvgConfig):  # every subclass's config_type is one
            msg = f"{self.name} needs a FedAvgConfig, got {type(config).__name__}"
            raise TypeError(msg)
        self.config: FedAvgConfig = config
        self.server_optimizer: ServerOptimizer = build_server_optimizer(config)
        self.center: Tensors = {}
        """Centered clipping's history: the previous round's combined delta."""

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Mean of the deltas, renormalized over the reporters, then the server step."""
        del round_id
        if not shared:
            return Aggregate(dict(shared))
        config = self.config
        uniform = config.weighs_equally()
        weights = [1.0 if uniform else float(u.num_samples) for u in updates]
        mean = robust_combine(
            [u.shared_delta for u in updates],
            weights,
            method=config.robust_aggregation,
            trim_fraction=config.trim_fraction,
            clip_norm=config.clip_update_norm,
            center=self.center or None,
            tau=config.cc_tau,
            iterations=config.cc_iterations,
        )
        if config.robust_aggregation == "centered-clipping":
            self.center = {k: v.clone() for k, v in mean.items() if v.is_floating_point()}
        return Aggregate(self.server_optimizer.step(shared, mean))

    def state_dict(self) -> dict[str, object]:
        """The server optimizer's state (empty for server SGD), and centered clipping's center."""
        state = self.server_optimizer.state_dict()
        if self.center:
            state[CENTER] = {k: v.tolist() for k, v in self.center.items()}
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the server optimizer and the center.

        Raises:
            ValueError: a center that is not a mapping of names to nested lists of floats.
        """
        center = state.get(CENTER, {})
        if not isinstance(center, dict):
            msg = f"{CENTER} must map tensor names to nested lists of floats"
            raise ValueError(msg)
        self.center = {k: torch.tensor(v, dtype=torch.float32) for k, v in center.items()}
        self.server_optimizer.load_state_dict({k: v for k, v in state.items() if k != CENTER})
