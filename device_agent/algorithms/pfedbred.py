"""pFedBreD and pFedMe, device half: a prior mean, a K-step prox solve, an envelope step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    phase_spec,
    require_config,
    round_result,
    train_phase,
)
from device_agent.algorithms.proximal_prior import MEMORY, iteration
from device_agent.algorithms.theta import (
    THETA,
    load_into,
    load_theta,
    model_parameters,
    stored,
    with_prefix,
)
from device_agent.training import (
    TrainStats,
    combine_stats,
    minibatches,
    snapshot,
    squared_distance,
    train,
)
from pfl_tasks.base import Split
from protocols.algorithms import ProximalPriorConfig
from protocols.codec import Tensors

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


class PFedBreDUpdate:
    """R iterations of: prior mean mu (spec §1.5), K prox steps on theta, envelope step on w.

    Spec §2.2 (the official code's order). Each iteration draws one minibatch (mh: two, the
    second used by the look-ahead's outer gradient, the K prox steps and nothing else). theta
    and the memory w_{i,R} persist in `LocalResult.state` as "theta.<name>" and
    "memory.<name>"; both start at the first w the device receives (§6 A5). Only w - w_global
    goes up.
    """

    name: ClassVar[str] = "pfedbred"

    def run(self, ctx: LocalContext) -> LocalResult:
        """One round of ClientUpdate_i (spec §2.2) from the received w."""
        cfg = require_config(ctx, ProximalPriorConfig)
        names = model_parameters(ctx)
        w = snapshot(ctx.model, names)
        theta = stored(ctx.state, THETA, names) or dict(w)
        memory = stored(ctx.state, MEMORY, names) or dict(w)
        draws = cfg.local_steps * (2 if cfg.prior_rule() == "mh" else 1)
        batches = minibatches(ctx.data.train, cfg.batch_size, draws, ctx.generator)
        solver = _DeviceSolver(ctx, cfg, batches)
        phases: list[TrainStats] = []
        if len(ctx.data.train):
            for _ in range(cfg.local_steps):
                w, theta, stats = iteration(solver, cfg, w, theta, memory)
                phases.append(stats)
            load_into(ctx.model, w)
        result = round_result(ctx, combine_stats(*phases))
        return LocalResult(
            shared_delta=result.shared_delta,
            num_samples=result.num_samples,
            train_loss=result.train_loss,
            personal=result.personal,
            state={**with_prefix(THETA, theta), **with_prefix(MEMORY, w)},
        )

    def personalize(self, ctx: LocalContext) -> None:
        """Deploy theta (spec §2.4, §6 A19), after `finetune_steps` "+FT" steps (§6 A11)."""
        cfg = require_config(ctx, ProximalPriorConfig)
        load_theta(ctx)
        if cfg.finetune_steps:
            spec = phase_spec(
                ctx,
                model_parameters(ctx),
                epochs=cfg.finetune_steps,
                lr=cfg.personal_lr,
                max_steps=cfg.finetune_steps,
            )
            train_phase(ctx, spec)

    def run_stacked(self, contexts: Sequence[LocalContext]) -> list[LocalResult]:
        """Many devices' rounds at once, each what `run` returns to float rounding.

        The batched trainer asks for this capability (`device_agent.batched.envelope`): the
        same `iteration` over every device's tensors stacked along a device dimension.
        """
        from device_agent.batched.envelope import run_envelope_rounds  # torch.func when batching

        return run_envelope_rounds(contexts)


class PFedMeUpdate(PFedBreDUpdate):
    """pFedMe: the same code path with mu = w (spec §5)."""

    name: ClassVar[str] = "pfedme"


class _DeviceSolver:
    """`Solver` on one device: its minibatch iterator and the one training loop on its model."""

    def __init__(self, ctx: LocalContext, cfg: ProximalPriorConfig, batches: Batches) -> None:
        self.ctx, self.cfg, self.batches = ctx, cfg, batches

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The iterator's next minibatch (its shuffle drawn lazily, as the loop draws it)."""
        return next(self.batches)

    def gradient_step(
        self, point: Tensors, batch: tuple[torch.Tensor, torch.Tensor], lr: float
    ) -> Tensors:
        """`_gradient_step` on this device."""
        return _gradient_step(self.ctx, point, batch, lr)

    def prox_solve(
        self, start: Tensors, mu: Tensors, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[Tensors, TrainStats]:
        """`_prox_solve` on this device."""
        return _prox_solve(self.ctx, self.cfg, start, mu, batch)


def _gradient_step(
    ctx: LocalContext, point: Tensors, batch: tuple[torch.Tensor, torch.Tensor], lr: float
) -> Tensors:
    """One full-batch SGD step of the training loop: point - lr grad f(point; batch)."""
    load_into(ctx.model, point)
    spec = phase_spec(ctx, tuple(point), epochs=1, lr=lr)
    train(ctx.model, ctx.task, Split(*batch), spec, ctx.generator, budget=ctx.budget)
    return snapshot(ctx.model, tuple(point))


def _prox_solve(
    ctx: LocalContext,
    cfg: ProximalPriorConfig,
    start: Tensors,
    mu: Tensors,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[Tensors, TrainStats]:
    """Approximate argmin f(theta; B) + lam/2 ||theta - mu||^2 by K GD steps (spec §2.2, A8)."""
    load_into(ctx.model, start)
    lam = cfg.lam
    spec = phase_spec(ctx, tuple(start), epochs=cfg.prox_steps, lr=cfg.personal_lr)
    stats = train(
        ctx.model,
        ctx.task,
        Split(*batch),
        spec,
        ctx.generator,
        budget=ctx.budget,
        extra_loss=lambda: 0.5 * lam * squared_distance(ctx.model, mu),
    )
    return snapshot(ctx.model, tuple(start)), stats
