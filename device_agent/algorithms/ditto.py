"""Ditto, device half: FedAvg's local SGD on w, and a personal theta pulled toward w by lam."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    PhasedUpdate,
    full_model_spec,
    phase_spec,
    require_config,
)
from device_agent.algorithms.theta import THETA, load_theta, model_parameters
from protocols.algorithms import DittoConfig


class DittoUpdate(PhasedUpdate):
    """Ditto (Li et al. 2021, Algorithm 1; pfedbred spec §5).

    theta <- theta - gamma_p (grad f(theta) + lam (theta - w^t)) for `personal_epochs` passes
    from the stored theta (the received w the first time), then w trains exactly as FedAvg
    from w^t. Only w - w^t goes up; theta stays in `LocalResult.state` as "theta.<name>", and
    the reported loss is w's.
    """

    name: ClassVar[str] = "ditto"

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """The personal solve for theta, then FedAvg's local update of w from w^t."""
        cfg = require_config(ctx, DittoConfig)
        personal = phase_spec(
            ctx,
            model_parameters(ctx),
            epochs=cfg.local_epochs if cfg.personal_epochs is None else cfg.personal_epochs,
            lr=cfg.lr if cfg.personal_lr is None else cfg.personal_lr,
            max_steps=cfg.max_steps,
        )
        return (
            BatchPhase(
                personal,
                proximal_mu=cfg.lam,
                proximal_to_received=True,
                from_state=THETA,
                kept_as=THETA,
                counted=False,
            ),
            BatchPhase(full_model_spec(ctx), restart=True),
        )

    def personalize(self, ctx: LocalContext) -> None:
        """Deploy theta; a device that never trained keeps the received w."""
        require_config(ctx, DittoConfig)
        load_theta(ctx)
