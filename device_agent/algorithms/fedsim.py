"""FedSim, device half: LocalSim, shared and personal steps together (spec §1.4)."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    PhasedUpdate,
    finetune_personal,
    phase_spec,
    require_config,
    trainable_parameters,
)
from protocols.algorithms import FedSimConfig


class FedSimUpdate(PhasedUpdate):
    """Jacobi local update: each minibatch's one backward pass moves u and v at once.

    Spec §1.4: for tau minibatches (`local_epochs`, capped at `max_steps`),
    v <- v - gamma_v g_v(w, v) and w <- w - gamma_u g_u(w, v), both gradients at the same
    point; gamma_u is `lr`, gamma_v is `personal_lr`, as two parameter groups of one phase.
    Only u+ - u goes up; v+ stays in `LocalResult.personal`.
    """

    name: ClassVar[str] = "fedsim"

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """One phase moving u and v together, each at its own step size."""
        cfg = require_config(ctx, FedSimConfig)
        gamma_v = cfg.personal_step_size()
        spec = phase_spec(
            ctx,
            ctx.split.shared + ctx.split.personal,
            epochs=cfg.local_epochs,
            lr=cfg.lr,
            max_steps=cfg.max_steps,
            lr_by_name={n: gamma_v for n in trainable_parameters(ctx.model, ctx.split.personal)},
        )
        return (BatchPhase(spec),)

    def personalize(self, ctx: LocalContext) -> None:
        """Stage c: fine-tune v only, u frozen at the final global value."""
        finetune_personal(ctx, require_config(ctx, FedSimConfig))
