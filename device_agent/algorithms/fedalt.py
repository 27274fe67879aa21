"""FedAlt, device half: LocalAlt, personal steps then shared steps (spec §1.3)."""

from __future__ import annotations

from typing import ClassVar

from device_agent.algorithms.base import (
    BatchPhase,
    LocalContext,
    PhasedUpdate,
    finetune_personal,
    phase_spec,
    require_config,
)
from protocols.algorithms import FedAltConfig


class FedAltUpdate(PhasedUpdate):
    """Gauss-Seidel local update: v moves with u frozen, then u moves with the new v frozen.

    Spec §1.3: v <- v - gamma_v g_v(u, v) for tau_v minibatches (`personal_epochs`, capped at
    `personal_max_steps`, at `personal_lr`), then w <- w - gamma_u g_u(w, v+) for tau_u
    minibatches (`local_epochs`, capped at `max_steps`, at `lr`). Frozen tensors get no gradient.
    Only u+ - u goes up; v+ stays in `LocalResult.personal`. The reported loss is the
    sample-weighted mean over both phases.
    """

    name: ClassVar[str] = "fedalt"

    def batch_phases(self, ctx: LocalContext) -> tuple[BatchPhase, ...]:
        """The personal phase, then the shared phase."""
        cfg = require_config(ctx, FedAltConfig)
        personal_phase = phase_spec(
            ctx,
            ctx.split.personal,
            epochs=cfg.local_epochs if cfg.personal_epochs is None else cfg.personal_epochs,
            lr=cfg.personal_step_size(),
            max_steps=cfg.personal_max_steps,
        )
        shared_phase = phase_spec(
            ctx, ctx.split.shared, epochs=cfg.local_epochs, lr=cfg.lr, max_steps=cfg.max_steps
        )
        return (BatchPhase(personal_phase), BatchPhase(shared_phase))

    def personalize(self, ctx: LocalContext) -> None:
        """Stage c: fine-tune v only, u frozen at the final global value."""
        finetune_personal(ctx, require_config(ctx, FedAltConfig))
