"""FedProx, device half: FedAvg's local SGD plus the proximal term mu/2 ||w - w_global||^2."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    PhasedUpdate,
    full_model_spec,
    require_config,
)
from protocols.algorithms import FedProxConfig


class FedProxUpdate(PhasedUpdate):
    """Local SGD on F_i(w) + mu/2 ||w_shared - w_global||^2 (FedProx, Li et al. 2020, Eq. 2)."""

    name: ClassVar[str] = "fedprox"

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """One phase on the whole model with the proximal term at mu."""
        cfg = require_config(ctx, FedProxConfig)
        return (BatchPhase(full_model_spec(ctx), proximal_mu=cfg.mu),)

    def personalize(self, ctx: LocalContext) -> None:
        """FedProx deploys the global model as it is."""
        del ctx
