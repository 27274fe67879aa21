"""pFedBreD's and pFedMe's local iteration, written once: the math both device paths share.

A prior mean mu (spec §1.5), K proximal steps on theta from a warm start, an envelope step on w
(spec §2.2), over a `Solver` that trains on one device (`device_agent.algorithms.pfedbred`) or
on many devices' stacked rows at once (`device_agent.batched.envelope`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

import torch

from protocols.algorithms import PFedBreDConfig, ProximalPriorConfig
from protocols.codec import Tensors

MEMORY = "memory."
"""State-name prefix of w_{i,R}^{(t-1)}, the local model at the end of the last round."""

BatchT = TypeVar("BatchT")
StatsT = TypeVar("StatsT", covariant=True)


def axpy(x: Mapping[str, torch.Tensor], a: float, y: Mapping[str, torch.Tensor]) -> Tensors:
    """Compute x + a * y per tensor."""
    return {name: x[name] + a * y[name] for name in x}


def memory_prior_mean(
    point: Mapping[str, torch.Tensor],
    memory: Mapping[str, torch.Tensor],
    theta: Mapping[str, torch.Tensor],
    eta: float,
) -> Tensors:
    """Prior mean from the memorized envelope gradient: point - eta (w_{i,R}^{(t-1)} - theta).

    Spec §1.5 Eq. 14: point = w (meg) or the look-ahead w - eta_alpha grad f (mh); theta is
    theta_{i,r-1}.
    """
    return {name: point[name] - eta * (memory[name] - theta[name]) for name in point}


def envelope_step(
    w: Mapping[str, torch.Tensor],
    mu: Mapping[str, torch.Tensor],
    theta: Mapping[str, torch.Tensor],
    lr: float,
    lam: float,
) -> Tensors:
    """First-order envelope-gradient step on w: w - alpha_m lam (mu - theta).

    Spec §1.4 (grad F_i(w) ~ lam (mu - theta), App. A.7) and §2.2's last line.
    """
    return {name: w[name] - lr * lam * (mu[name] - theta[name]) for name in w}


class Solver(Protocol[BatchT, StatsT]):
    """The training steps of an iteration, on one device's tensors or many devices' at once.

    `iteration` writes the algorithm once over these and the elementwise tensor arithmetic
    above, so the per-device round and the stacked one (`device_agent.batched.envelope`)
    share its equations.
    """

    def next_batch(self) -> BatchT:
        """The round's next minibatch (each device's own draw)."""
        ...

    def gradient_step(self, point: Tensors, batch: BatchT, lr: float) -> Tensors:
        """One full-batch SGD step of the training loop: point - lr grad f(point; batch)."""
        ...

    def prox_solve(self, start: Tensors, mu: Tensors, batch: BatchT) -> tuple[Tensors, StatsT]:
        """Theta approximately minimizing f(theta; B) + lam/2 ||theta - mu||^2, from `start`."""
        ...


def iteration(
    solver: Solver[BatchT, StatsT],
    cfg: ProximalPriorConfig,
    w: Tensors,
    theta: Tensors,
    memory: Tensors,
) -> tuple[Tensors, Tensors, StatsT]:
    """One local iteration r: returns (w_r, theta_r, the prox solve's stats). Spec §2.2."""
    batch = solver.next_batch()
    if not isinstance(cfg, PFedBreDConfig) or cfg.prior == "identity":
        theta_next, stats = solver.prox_solve(_warm_start(cfg, w, w, w, theta), w, batch)
        return envelope_step(w, w, theta_next, cfg.lr, cfg.lam), theta_next, stats
    rule, eta, eta_alpha = cfg.prior, cfg.eta, cfg.eta_alpha
    if rule == "lg":  # mu = w - eta_alpha grad f(w; B); the solve starts at mu
        mu = solver.gradient_step(w, batch, eta_alpha)
        start = mu
    elif rule == "meg":
        mu, start = memory_prior_mean(w, memory, theta, eta), w
    else:  # mh (Eq. 22, two batches) or mh_simple (Eq. 14)
        ahead = solver.gradient_step(w, batch, eta_alpha)
        if rule == "mh":  # w - eta_alpha grad f(w - eta_alpha grad f(w; B1); B2)
            batch = solver.next_batch()
            outer = solver.gradient_step(ahead, batch, eta_alpha)
            ahead = axpy(w, 1.0, axpy(outer, -1.0, ahead))
        if cfg.meta_step_updates_w:  # §6 A1, the code's behaviour
            w = ahead
        mu, start = memory_prior_mean(ahead, memory, theta, eta), w
    theta_next, stats = solver.prox_solve(_warm_start(cfg, start, w, mu, theta), mu, batch)
    return envelope_step(w, mu, theta_next, cfg.lr, cfg.lam), theta_next, stats


def _warm_start(
    cfg: ProximalPriorConfig, code: Tensors, w: Tensors, mu: Tensors, theta: Tensors
) -> Tensors:
    """Where the prox solve starts: the code's choice, or `prox_init`'s (spec §6 A3)."""
    if cfg.prox_init is None:
        return code
    return {"local": w, "mu": mu, "prev_theta": theta}[cfg.prox_init]
