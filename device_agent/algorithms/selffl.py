"""Self-FL, device half: Eq. (10) start, Eq. (8) step count, streaming Eq. (13) variance."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from device_agent.algorithms.base import (
    LocalContext,
    LocalResult,
    phase_spec,
    require_config,
    train_phase,
    trainable_parameters,
)
from device_agent.training import (
    TrainSpec,
    TrainStats,
    combine_stats,
    difference,
    snapshot,
)
from protocols.algorithms import (
    SELFFL_LOCAL_STEPS,
    SELFFL_S_MINUS,
    SELFFL_SIGMA0_SQ,
    SELFFL_SIGMA_M_SQ,
    SelfFlAugConfig,
    SelfFlConfig,
    StepRule,
)
from protocols.codec import Tensors

PERSONAL = "personal."
"""State prefix of the personal model theta_m (the model this device deploys)."""
MEAN = "mean."
"""State prefix of the running mean xbar of the Eq. (13) samples."""
ANCHOR = "anchor."
"""State prefix of Algorithm 2's latest local optimum theta_{m,t-1}."""
STATS = "stats"
"""State name of the float64 vector [activations n, weight sum W, variance s]."""


@dataclass(frozen=True)
class RunningVariance:
    """Eq. (18)'s statistics of a stream of tensor dicts in O(P) memory (selffl.md §2.3)."""

    mean: Tensors
    count: int
    weight: float
    variance: float


def update_running_variance(
    previous: RunningVariance | None, sample: Mapping[str, torch.Tensor], forgetting: float = 1.0
) -> RunningVariance:
    """Add one sample by the corrected recurrence (selffl.md §2.3, A15; Eq. 19 with the square).

    xbar_t = xbar_{t-1} + (x_t - xbar_{t-1}) / W_t and s_t = ((W_t-1)/W_t) s_{t-1} +
    ((W_t-1)/W_t) ||xbar_t - xbar_{t-1}||^2 + ||x_t - xbar_t||^2 / W_t, with W_t = gamma W_{t-1}
    + 1; gamma = `forgetting` = 1 gives W_t = t and s_t = (1/t) sum_i ||x_i - xbar_t||^2 (Eq. 18,
    the trace of the biased scatter). Computed in float64.
    """
    x = {name: value.detach().to(torch.float64) for name, value in sample.items()}
    if previous is None or previous.count == 0:
        return RunningVariance(x, 1, 1.0, 0.0)
    weight = forgetting * previous.weight + 1.0
    mean = {name: old + (x[name] - old) / weight for name, old in previous.mean.items()}
    shift = sum(float(((mean[n] - previous.mean[n]) ** 2).sum()) for n in mean)
    spread = sum(float(((x[n] - mean[n]) ** 2).sum()) for n in mean)
    keep = (weight - 1.0) / weight
    variance = keep * previous.variance + keep * shift + spread / weight
    return RunningVariance(mean, previous.count + 1, weight, variance)


def step_count(
    sigma_m_sq: float,
    s_minus: float,
    lr: float,
    *,
    rule: StepRule = "eq8",
    l_max: int = 40,
    l_default: int = 20,
    fixed_rho: float = 0.05,
    batch_size: int = 1,
    on_invalid_rate: Literal["l_max", "one"] = "l_max",
    eps: float = 1e-12,
) -> tuple[int, float]:
    """l_m solving Eq. (8), (1 - rho_m)^l = S_{-m} / (sigma_m^{-2} + S_{-m}), clipped to [1, l_max].

    rho_m is eta/sigma_m^2 ("eq8"), eta/(B sigma_m^2) ("alg2", Eq. 21) or `fixed_rho`; "fixed"
    returns `l_default`. Edge cases (selffl.md §2.6): S_{-m} <= 0 or not finite gives l_max;
    rho_m >= 1 or sigma_m^2 <= eps gives l_max (1 with `on_invalid_rate` "one"); NaN gives
    `l_default` (also for NaN inputs).

    Returns:
        The step count and the raw real-valued l* (inf/nan where the edge cases apply).
    """
    if rule == "fixed":
        return l_default, float(l_default)
    if math.isnan(sigma_m_sq) or math.isnan(s_minus) or math.isnan(lr):
        return l_default, math.nan
    if not (math.isfinite(s_minus) and s_minus > 0):
        return l_max, math.inf
    rho = {
        "eq8": lr / sigma_m_sq if sigma_m_sq > eps else math.inf,
        "alg2": lr / (batch_size * sigma_m_sq) if sigma_m_sq > eps else math.inf,
        "fixed_rho": fixed_rho,
    }.get(rule)
    if rho is None:
        msg = f"unknown step_rule {rule!r}; choose one of: eq8, alg2, fixed_rho, fixed"
        raise ValueError(msg)
    if not sigma_m_sq > eps or not rho < 1:
        return (1 if on_invalid_rate == "one" else l_max), math.inf
    raw = math.log1p(1.0 / (sigma_m_sq * s_minus)) / -math.log1p(-rho)
    if math.isnan(raw):
        return l_default, raw
    return int(min(max(math.floor(raw + 0.5), 1), l_max)), raw


def adjusted_init(global_shared: Tensors, anchor: Tensors, push: float) -> Tensors:
    """Eq. (10): theta^{t-1} - (w_m / S_{-m}) (theta_m^{t-1} - theta^{t-1}); `push` = w_m/S_{-m}.

    The start moves away from the anchor (the personal model; Algorithm 2's last local optimum,
    Eq. 21). Only the anchor's names move; a zero push returns the global values.
    """
    return {
        name: global_shared[name] - push * (anchor[name] - global_shared[name]) for name in anchor
    }


def init_push(
    sigma_m_sq: float | None, sigma0_sq: float | None, s_minus: float | None, eps: float = 1e-12
) -> float | None:
    """w_m / S_{-m} = 1 / ((sigma_0^2 + sigma_m^2) S_{-m}) (Eq. 10), None where undefined (A8)."""
    if sigma_m_sq is None or sigma0_sq is None or s_minus is None:
        return None
    precision_inverse = sigma0_sq + sigma_m_sq
    if not (math.isfinite(precision_inverse) and precision_inverse > eps):
        return None
    if not (math.isfinite(s_minus) and s_minus > 0):
        return None
    return 1.0 / (precision_inverse * s_minus)


def load_history(
    state: Mapping[str, torch.Tensor], names: tuple[str, ...]
) -> RunningVariance | None:
    """The running statistics kept in `state`, None before the first activation."""
    stats = state.get(STATS)
    if stats is None or any(MEAN + name not in state for name in names):
        return None
    count, weight, variance = (float(v) for v in stats.to(torch.float64))
    mean = {name: state[MEAN + name].to(torch.float64) for name in names}
    return RunningVariance(mean, int(count), weight, variance)


def history_state(history: RunningVariance) -> Tensors:
    """The running statistics as state tensors (selffl.md §2.3: P floats + 2 scalars + 1 count)."""
    stats = torch.tensor([history.count, history.weight, history.variance], dtype=torch.float64)
    return {STATS: stats, **{MEAN + name: value for name, value in history.mean.items()}}


def prefixed(
    state: Mapping[str, torch.Tensor], prefix: str, names: tuple[str, ...]
) -> Tensors | None:
    """The tensors `prefix + name` for every name, None unless all are present."""
    if not names or any(prefix + name not in state for name in names):
        return None
    return {name: state[prefix + name] for name in names}


class SelfFlUpdate:
    """Algorithm 1's client step (selffl.md §2.7): Eq. (10) start, l_m steps, Eq. (13) update.

    sigma_m^2 is the pre-training value (A7; oracle v^2/N_m if configured); missing downlink
    scalars, fewer than `min_activations` activations or a disabled toggle fall back to the
    global start and `l_default` steps. Private (personal-split) layers train for the same steps.
    """

    name: ClassVar[str] = "selffl"
    anchor_prefix: ClassVar[str] = PERSONAL

    def run(self, ctx: LocalContext) -> LocalResult:
        """One activation: returns the shared delta, sigma_m^2 and the updated state."""
        cfg = require_config(ctx, SelfFlConfig)
        names = trainable_parameters(ctx.model, ctx.split.shared)
        history = load_history(ctx.state, names)
        sigma_m_sq = self._own_variance(cfg, ctx, history)
        steps = self._start(cfg, ctx, names, sigma_m_sq)
        stats = train_phase(ctx, self._spec(ctx, cfg, steps))
        personal_model = snapshot(ctx.model, ctx.split.shared)
        private = snapshot(ctx.model, ctx.split.personal)
        sample, extra, stats = self._sample(ctx, cfg, personal_model, stats)
        history = update_running_variance(history, {n: sample[n] for n in names}, cfg.forgetting)
        if cfg.send_updated_sigma and cfg.per_sample_variance is None:
            sigma_m_sq = history.variance if history.count >= cfg.min_activations else None
        scalars = {SELFFL_LOCAL_STEPS: float(steps)}
        if sigma_m_sq is not None and math.isfinite(sigma_m_sq):
            scalars[SELFFL_SIGMA_M_SQ] = sigma_m_sq
        state = {
            **{PERSONAL + n: v for n, v in personal_model.items()},
            **extra,
            **history_state(history),
        }
        return LocalResult(
            shared_delta=difference(sample, ctx.global_shared),
            num_samples=len(ctx.data.train),
            train_loss=stats.mean_loss,
            personal=private,
            scalars=scalars,
            state=state,
        )

    def personalize(self, ctx: LocalContext) -> None:
        """Load the personal model theta_m (the global one until the first activation, A20)."""
        personal_model = prefixed(ctx.state, PERSONAL, ctx.split.shared)
        if personal_model is not None:
            _load(ctx, personal_model)

    def _own_variance(
        self, cfg: SelfFlConfig, ctx: LocalContext, history: RunningVariance | None
    ) -> float | None:
        """sigma_m^2: oracle v^2/N_m (Eq. 16), else Eq. (13) over past activations, else None."""
        if cfg.per_sample_variance is not None:
            return cfg.per_sample_variance / max(len(ctx.data.train), 1)
        if history is None or history.count < cfg.min_activations:
            return None
        return history.variance

    def _start(
        self, cfg: SelfFlConfig, ctx: LocalContext, names: tuple[str, ...], sigma_m_sq: float | None
    ) -> int:
        """Load the Eq. (10) start into the model and return l_m (selffl.md §2.7, §2.6)."""
        sigma0_sq = ctx.assignment.get(SELFFL_SIGMA0_SQ)
        s_minus = ctx.assignment.get(SELFFL_S_MINUS)
        anchor = prefixed(ctx.state, self.anchor_prefix, names)
        push = init_push(sigma_m_sq, sigma0_sq, s_minus, cfg.eps)
        if cfg.adjust_init and anchor is not None and push is not None:
            global_part = {name: ctx.global_shared[name] for name in names}
            _load(ctx, adjusted_init(global_part, anchor, push))
        if not cfg.adaptive_steps or sigma_m_sq is None or s_minus is None:
            return cfg.l_default
        steps, _ = step_count(
            sigma_m_sq,
            s_minus,
            cfg.lr,
            rule=cfg.step_rule,
            l_max=cfg.l_max,
            l_default=cfg.l_default,
            fixed_rho=cfg.fixed_rho,
            batch_size=min(cfg.batch_size, max(len(ctx.data.train), 1)),
            on_invalid_rate=cfg.on_invalid_rate,
            eps=cfg.eps,
        )
        return steps

    @staticmethod
    def _spec(
        ctx: LocalContext, cfg: SelfFlConfig, steps: int, *, epochs: int | None = None
    ) -> TrainSpec:
        """l_m minibatch steps (or epochs, `step_unit`) on every parameter at `lr`."""
        names = ctx.split.shared + ctx.split.personal
        if epochs is not None or cfg.step_unit == "epochs":
            return phase_spec(ctx, names, epochs=epochs or steps, lr=cfg.lr)
        per_epoch = max(1, math.ceil(len(ctx.data.train) / cfg.batch_size))
        return phase_spec(
            ctx, names, epochs=math.ceil(steps / per_epoch), lr=cfg.lr, max_steps=steps
        )

    def _sample(
        self, ctx: LocalContext, cfg: SelfFlConfig, personal_model: Tensors, stats: TrainStats
    ) -> tuple[Tensors, Tensors, TrainStats]:
        """Algorithm 1 uploads and measures the personal model itself."""
        del ctx, cfg
        return personal_model, {}, stats


class SelfFlAugUpdate(SelfFlUpdate):
    """Algorithm 2's client step (selffl.md §3): the local optimum replaces the personal model.

    After the l_m steps (the personal model), SGD continues to a local optimum theta_{m,t}, which
    is uploaded, fed to Eq. (20) and kept as the next Eq. (21) anchor; private layers keep their
    values after the l_m steps.
    """

    name: ClassVar[str] = "selffl-aug"
    anchor_prefix: ClassVar[str] = ANCHOR

    def _sample(
        self, ctx: LocalContext, cfg: SelfFlConfig, personal_model: Tensors, stats: TrainStats
    ) -> tuple[Tensors, Tensors, TrainStats]:
        """Train on to convergence (conv_tol, conv_max_epochs) and return theta_{m,t}."""
        aug = require_config(ctx, SelfFlAugConfig)
        private = snapshot(ctx.model, ctx.split.personal)
        phases, previous = [stats], None
        for _ in range(aug.conv_max_epochs):
            epoch = train_phase(ctx, self._spec(ctx, cfg, 1, epochs=1))
            phases.append(epoch)
            loss = epoch.mean_loss
            if previous is not None and abs(previous - loss) <= aug.conv_tol * abs(previous):
                break
            previous = loss
        optimum = snapshot(ctx.model, ctx.split.shared)
        _load(ctx, {**personal_model, **private})
        return optimum, {ANCHOR + n: v for n, v in optimum.items()}, combine_stats(*phases)


@torch.no_grad()
def _load(ctx: LocalContext, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy named tensors into the model's parameters and buffers."""
    state = ctx.model.state_dict(keep_vars=True)
    for name, value in tensors.items():
        state[name].copy_(value.to(state[name].dtype))
