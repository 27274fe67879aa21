"""Ditto, device half: FedAvg's local SGD on w, and a personal theta pulled toward w by lam."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    phase_spec,
    require_config,
    train_phase,
    train_whole_model,
)
from device_agent.algorithms.theta import (
    THETA,
    load_into,
    load_theta,
    model_parameters,
    stored,
    with_prefix,
)
from device_agent.training import snapshot, squared_distance
from protocols.algorithms import DittoConfig


class DittoUpdate:
    """Ditto (Li et al. 2021, Algorithm 1; pfedbred spec §5).

    theta <- theta - gamma_p (grad f(theta) + lam (theta - w^t)) for `personal_epochs` passes
    from the stored theta (the received w the first time), then w trains exactly as FedAvg
    from w^t. Only w - w^t goes up; theta stays in `LocalResult.state` as "theta.<name>".
    """

    name: ClassVar[str] = "ditto"

    def run(self, ctx: LocalContext) -> LocalResult:
        """One round: the personal solve, then FedAvg's local update."""
        cfg = require_config(ctx, DittoConfig)
        names = model_parameters(ctx)
        received = snapshot(ctx.model, names)  # w^t: global shared + this device's personal part
        load_into(ctx.model, stored(ctx.state, THETA, names) or received)
        lam = cfg.lam
        spec = phase_spec(
            ctx,
            names,
            epochs=cfg.local_epochs if cfg.personal_epochs is None else cfg.personal_epochs,
            lr=cfg.lr if cfg.personal_lr is None else cfg.personal_lr,
            max_steps=cfg.max_steps,
        )
        train_phase(ctx, spec, extra_loss=lambda: 0.5 * lam * squared_distance(ctx.model, received))
        theta = snapshot(ctx.model, names)
        load_into(ctx.model, received)
        result = train_whole_model(ctx)
        return LocalResult(
            shared_delta=result.shared_delta,
            num_samples=result.num_samples,
            train_loss=result.train_loss,
            personal=result.personal,
            state=with_prefix(THETA, theta),
        )

    def personalize(self, ctx: LocalContext) -> None:
        """Deploy theta; a device that never trained keeps the received w."""
        require_config(ctx, DittoConfig)
        load_theta(ctx)
