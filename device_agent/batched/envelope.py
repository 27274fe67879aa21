"""pFedMe's and pFedBreD's rounds for many devices at once: their `iteration` on stacked tensors.

A round of theirs is not phases of the one training loop: each iteration draws a minibatch,
may take gradient steps on it (the pFedBreD priors), solves a proximal problem on it in K steps
and moves w by an envelope step. `device_agent.algorithms.pfedbred.iteration` writes that once
over a `Solver`; here the solver's points are every device's parameters as the rows of one
[D, P] tensor (`FlatLayout`), so the prior means and the envelope step are the per-device
arithmetic on whole rows, and a training step is one forward of the D models
(`stacked_forward`), one backward over the sum of the devices' losses and one `FlatSgd` step.

Each device draws from its own generator what its per-device round draws, in the same order:
the round's shuffle when an epoch of its minibatch iterator starts, then the shuffle of the
one-batch epoch of every training step on that minibatch. A device's batch smaller than
another's is padded and masked. Non-finite losses or gradients are read once, at the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    phase_spec,
    require_config,
)
from device_agent.algorithms.proximal_prior import MEMORY, iteration
from device_agent.algorithms.theta import THETA, model_parameters, stored, with_prefix
from device_agent.batched.flat_sgd import FlatLayout, FlatSgd
from device_agent.batched.forward import sample_losses, stacked_forward
from device_agent.training import TrainStats, chunks, combine_stats, difference
from protocols.algorithms import ProximalPriorConfig
from protocols.codec import Tensors
from protocols.errors import TrainingError

FLAT = "flat"
"""The one name in a stacked point: every device's parameters, one [D, P] row each."""


@dataclass(frozen=True)
class StackedBatch:
    """One minibatch of each device: [D, B] positions into the concatenated splits."""

    index: torch.Tensor
    """Padding repeats the device's first row of the batch."""
    mask: torch.Tensor
    """[D, B] bool: which positions are the device's rows."""
    sizes: list[int]
    counts: torch.Tensor
    """[D] the sizes, as the divisor of each device's mean loss."""


@dataclass(frozen=True)
class SolveStats:
    """One prox solve of every device: K steps, each device's samples and summed loss."""

    steps: int
    samples: list[int]
    sums: torch.Tensor
    """[D] float64: each step's mean task loss times its batch size, summed over the steps."""


class StackedSolver:
    """`pfedbred.Solver` on the devices of `contexts` at once (all with training data)."""

    def __init__(
        self, contexts: Sequence[LocalContext], cfg: ProximalPriorConfig, names: tuple[str, ...]
    ) -> None:
        first = contexts[0]
        self.forward, transposed = stacked_forward(first.model)
        self.layout = FlatLayout(first.model, transposed)
        if set(names) != set(self.layout.names):
            msg = "w covers only some of the model's parameters"
            raise ValueError(msg)
        self.ctx, self.cfg, self.names = first, cfg, names
        splits = [ctx.data.train for ctx in contexts]
        self.inputs = torch.cat([split.inputs for split in splits])
        self.targets = torch.cat([split.targets for split in splits])
        counts = [len(split) for split in splits]
        self.offsets = [sum(counts[:d]) for d in range(len(counts))]
        self.bounds = [chunks(count, cfg.batch_size) for count in counts]
        self.generators = [ctx.generator for ctx in contexts]
        self._orders: list[torch.Tensor | None] = [None] * len(contexts)
        self._positions = [0] * len(contexts)
        self._checks: list[torch.Tensor] = []
        """Scalars that must be finite: losses, and whether every clipped norm was."""

    def next_batch(self) -> StackedBatch:
        """Each device's next minibatch, its epoch's shuffle drawn when the epoch starts."""
        rows = []
        for d, generator in enumerate(self.generators):
            order = self._orders[d]
            if order is None or self._positions[d] == len(self.bounds[d]):
                count = self.bounds[d][-1][1]
                order = self._orders[d] = torch.randperm(count, generator=generator)
                self._positions[d] = 0
            start, end = self.bounds[d][self._positions[d]]
            self._positions[d] += 1
            rows.append(order[start:end] + self.offsets[d])
        sizes = [len(row) for row in rows]
        width = self.cfg.batch_size  # not the group's largest: a device's sums keep their length
        index = torch.stack([torch.cat([r, r[:1].expand(width - len(r))]) for r in rows])
        mask = torch.arange(width).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
        return StackedBatch(index, mask, sizes, torch.tensor(sizes, dtype=torch.float32))

    def gradient_step(self, point: Tensors, batch: StackedBatch, lr: float) -> Tensors:
        """Every device's point - lr grad f(point; its batch), as the training loop steps."""
        spec = phase_spec(self.ctx, self.names, epochs=1, lr=lr)
        rows = point[FLAT].detach().clone().requires_grad_(True)
        loss = self._losses(rows, batch)
        loss.sum().backward()
        self._step(FlatSgd(spec, self.layout), rows, loss)
        return {FLAT: rows.detach()}

    def prox_solve(
        self, start: Tensors, mu: Tensors, batch: StackedBatch
    ) -> tuple[Tensors, SolveStats]:
        """K steps on f(theta; B) + lam/2 ||theta - mu||^2 per device, from `start`."""
        cfg = self.cfg
        spec = phase_spec(self.ctx, self.names, epochs=cfg.prox_steps, lr=cfg.personal_lr)
        optimizer = FlatSgd(spec, self.layout)  # a fresh optimizer per solve, as `train` makes
        rows = start[FLAT].detach().clone().requires_grad_(True)
        sums = torch.zeros(len(batch.sizes), dtype=torch.float64)
        for _ in range(cfg.prox_steps):
            rows.grad = None
            loss = self._losses(rows, batch)
            proximal = 0.5 * cfg.lam * ((rows - mu[FLAT]) ** 2).sum(dim=1)
            (loss + proximal).sum().backward()
            self._step(optimizer, rows, loss)
            sums += loss.detach().double() * batch.counts.double()
        samples = [cfg.prox_steps * size for size in batch.sizes]
        return {FLAT: rows.detach()}, SolveStats(cfg.prox_steps, samples, sums)

    def check(self) -> None:
        """Raise what the per-device loop raises on a non-finite loss or gradient.

        Raises:
            TrainingError: some device's loss or clipped gradient norm became non-finite.
        """
        if self._checks and not bool(torch.isfinite(torch.stack(self._checks)).all()):
            msg = "a loss or gradient became non-finite"
            raise TrainingError(msg)

    def _losses(self, rows: torch.Tensor, batch: StackedBatch) -> torch.Tensor:
        """[D] each device's mean task loss on its batch, rows in the order its step shuffles."""
        positions = torch.arange(batch.index.shape[1])
        shuffles = [
            torch.cat([torch.randperm(size, generator=generator), positions[size:]])
            for size, generator in zip(batch.sizes, self.generators, strict=True)
        ]
        index = batch.index.gather(1, torch.stack(shuffles))
        outputs = self.forward(self.layout.views(rows), self.inputs[index])
        per_sample = sample_losses(self.ctx.task, outputs, self.targets[index])
        return torch.where(batch.mask, per_sample, 0.0).sum(dim=1) / batch.counts

    def _step(self, optimizer: FlatSgd, rows: torch.Tensor, loss: torch.Tensor) -> None:
        assert rows.grad is not None
        optimizer.step(rows, rows.grad, len(rows))
        self._checks.append(loss.detach().sum())
        self._checks.append(torch.where(optimizer.finite, 0.0, math.inf))


def run_envelope_rounds(contexts: Sequence[LocalContext]) -> list[LocalResult]:
    """`PFedBreDUpdate.run` of every context (one algorithm and config), trained stacked.

    Raises:
        TrainingError: some device's loss or gradient became non-finite.
        ValueError: w is not the whole model (the per-device path handles it).
    """
    cfg = require_config(contexts[0], ProximalPriorConfig)
    names = model_parameters(contexts[0])
    starts = [_start(ctx, names) for ctx in contexts]
    trained: dict[int, tuple[Tensors, Tensors, list[TrainStats]]] = {}
    training = [d for d, ctx in enumerate(contexts) if len(ctx.data.train)]
    if training:
        solver = StackedSolver([contexts[d] for d in training], cfg, names)
        layout = solver.layout
        w = {FLAT: layout.stack([starts[d] for d in training])}
        theta = {FLAT: layout.stack([_kept(contexts[d], THETA, starts[d]) for d in training])}
        memory = {FLAT: layout.stack([_kept(contexts[d], MEMORY, starts[d]) for d in training])}
        solves: list[SolveStats] = []
        for _ in range(cfg.local_steps):
            w, theta, stats = iteration(solver, cfg, w, theta, memory)
            solves.append(stats)
        solver.check()
        sums = torch.stack([solve.sums for solve in solves]).tolist()  # [R, D]
        rows = zip(training, layout.rows(w[FLAT]), layout.rows(theta[FLAT]), strict=True)
        for row, (d, w_d, theta_d) in enumerate(rows):
            stats_d = [
                TrainStats(s.steps, s.samples[row], sums[r][row] / s.samples[row])
                for r, s in enumerate(solves)
            ]
            trained[d] = w_d, theta_d, stats_d
    results = []
    for d, ctx in enumerate(contexts):
        start = starts[d]
        w_d, theta_d, stats_d = trained.get(d, (start, _kept(ctx, THETA, start), []))
        results.append(_result(ctx, w_d, theta_d, stats_d))
    return results


def _start(ctx: LocalContext, names: tuple[str, ...]) -> Tensors:
    """The received w: what the device's model holds when its round starts."""
    received = {**ctx.global_shared, **ctx.personal}
    return {name: received[name] for name in names}


def _kept(ctx: LocalContext, prefix: str, start: Tensors) -> Tensors:
    """The tensors the device keeps under `prefix`, or `start` (a fresh device's, §6 A5)."""
    return stored(ctx.state, prefix, tuple(start)) or dict(start)


def _result(ctx: LocalContext, w: Tensors, theta: Tensors, stats: list[TrainStats]) -> LocalResult:
    """What `PFedBreDUpdate.run` reports for a device that ended its round at `w`, `theta`."""
    live = {**ctx.global_shared, **ctx.personal, **w}
    return LocalResult(
        shared_delta=difference(live, ctx.global_shared),
        num_samples=len(ctx.data.train),
        train_loss=combine_stats(*stats).mean_loss,
        personal={name: live[name].clone() for name in ctx.split.personal},
        state={**with_prefix(THETA, theta), **with_prefix(MEMORY, w)},
    )
