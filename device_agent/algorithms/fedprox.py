"""FedProx, device half: FedAvg's local SGD plus the proximal term mu/2 ||w - w_global||^2."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import LocalContext, LocalResult, train_whole_model
from device_agent.training import squared_distance
from protocols.algorithms import FedProxConfig


class FedProxUpdate:
    """Local SGD on F_i(w) + mu/2 ||w_shared - w_global||^2 (FedProx, Li et al. 2020, Eq. 2)."""

    name: ClassVar[str] = "fedprox"

    def run(self, ctx: LocalContext) -> LocalResult:
        """Train with the proximal pull toward the received shared parameters."""
        cfg = ctx.config
        if not isinstance(cfg, FedProxConfig):
            msg = f"fedprox needs FedProxConfig, got {type(cfg).__name__}"
            raise TypeError(msg)
        mu = cfg.mu
        return train_whole_model(
            ctx, extra_loss=lambda: 0.5 * mu * squared_distance(ctx.model, ctx.global_shared)
        )

    def personalize(self, ctx: LocalContext) -> None:
        """FedProx deploys the global model as it is."""
        del ctx
