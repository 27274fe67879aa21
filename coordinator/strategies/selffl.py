"""Self-FL, coordinator half: sigma_0^2 (Eq. 14), S_{-m} per device, precision weights (Eq. 11)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fnmatch import fnmatch
from typing import ClassVar

import numpy as np
import torch

from coordinator.engine.selection import select_devices
from coordinator.strategies.aggregate import apply_delta, weighted_mean
from coordinator.strategies.base import (
    Aggregate,
    FleetSnapshot,
    ReceivedUpdate,
    RoundPlan,
)
from protocols.algorithms import (
    SELFFL_LOCAL_STEPS,
    SELFFL_S_MINUS,
    SELFFL_SIGMA0_SQ,
    SELFFL_SIGMA_M_SQ,
    AggregationWeights,
    AlgorithmConfig,
    SelfFlAugConfig,
    SelfFlConfig,
)
from protocols.codec import Tensors


def trace_variance(samples: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str]) -> float:
    """(1/n) sum_i ||x_i - xbar||^2 over `names` (Eq. 14 with A3's normalization, A17).

    Shift-invariant, so deltas against one global model give the same value as the models
    (selffl.md §2.4, §7 oracle 5). One sample gives 0.
    """
    if not samples:
        return 0.0
    total = 0.0
    for name in names:
        stacked = torch.stack([s[name].detach().to(torch.float64).reshape(-1) for s in samples])
        total += float(((stacked - stacked.mean(dim=0)) ** 2).sum()) / len(samples)
    return total


def precision_weights(sigma0_sq: float, sigma_sq: Sequence[float]) -> list[float]:
    """alpha_m = (sigma_0^2 + sigma_m^2)^{-1} / sum_k (sigma_0^2 + sigma_k^2)^{-1} (Eq. 11).

    Normalized after subtracting the largest log-weight, in float64 (selffl.md §4.4).

    Raises:
        ValueError: some sigma_0^2 + sigma_m^2 is not a positive finite number.
    """
    totals = np.asarray([sigma0_sq + s for s in sigma_sq], dtype=np.float64)
    if totals.size == 0 or not np.all(np.isfinite(totals) & (totals > 0)):
        msg = f"precision weights need positive finite variances, got {totals.tolist()}"
        raise ValueError(msg)
    log_weights = -np.log(totals)
    weights = np.exp(log_weights - log_weights.max())
    return [float(w) for w in weights / weights.sum()]


def others_precision(
    sigma0_sq: float, sigma_sq: Mapping[str, float], devices: Sequence[str]
) -> dict[str, float]:
    """S_{-m} = sum_{k in pool, k != m} (sigma_0^2 + sigma_k^2)^{-1} for each m in `devices`.

    The pool is `sigma_sq`'s keys (selffl.md §2.4, A2); a device outside it gets the full sum.
    """
    precision = {k: 1.0 / (sigma0_sq + s) for k, s in sigma_sq.items()}
    total = math.fsum(precision.values())
    return {m: total - precision.get(m, 0.0) for m in devices}


def impute_variances(
    reported: Mapping[str, float | None],
    eps: float,
    oracle: Mapping[str, float] | None = None,
) -> dict[str, float] | None:
    """Valid sigma_k^2 (finite, > eps) kept; others from `oracle`, else the valid mean (§2.4).

    Returns None when some value is missing and nothing can impute it.
    """
    valid = {k: float(v) for k, v in reported.items() if v is not None and _valid(v, eps)}
    fill = math.fsum(valid.values()) / len(valid) if valid else None
    result: dict[str, float] = {}
    for key in reported:
        value = valid.get(key)
        if value is None and oracle is not None and key in oracle:
            value = oracle[key]
        if value is None:
            value = fill
        if value is None:
            return None
        result[key] = value
    return result


def _valid(value: float | None, eps: float) -> bool:
    return value is not None and math.isfinite(value) and value > eps


class SelfFlStrategy:
    """Algorithm 1's server (selffl.md §2.7), also Algorithm 2's (§3, A16).

    Plans send each device sigma_0^2-hat and its S_{-m} from the table of latest reported
    sigma_k^2 (missing entries: oracle v^2/N_k, else the mean); nothing is sent in warm-up or
    before the first estimate, so devices fall back (A8). Aggregation: Eq. (14) on the round's
    deltas, weights (sigma_0^2 + sigma_m^2)^{-1} (FedAvg weights in warm-up, `fallback_weights`
    while no device has a valid sigma_m^2), then theta^t = theta^{t-1} + beta * mean delta.
    """

    name: ClassVar[str] = "selffl"
    config_type: ClassVar[type[AlgorithmConfig]] = SelfFlConfig

    def __init__(self, config: AlgorithmConfig, participation: float) -> None:
        if not isinstance(config, SelfFlConfig) or not isinstance(config, self.config_type):
            msg = f"{self.name} needs {self.config_type.__name__}, got {type(config).__name__}"
            raise TypeError(msg)
        self.config: SelfFlConfig = config
        self.participation = participation
        self.beta = config.smoothing_beta if config.smoothing_beta is not None else participation
        self.sigma0_sq: float | None = config.sigma0_sq
        self.table: dict[str, float] = {}

    def plan_round(
        self, round_id: int, fleet: FleetSnapshot, rng: np.random.Generator
    ) -> RoundPlan:
        """A uniform sample; each chosen device gets sigma_0^2-hat and its S_{-m} when known."""
        cfg = self.config
        devices = select_devices(fleet.online(), self.participation, rng)
        if round_id <= cfg.warmup_rounds or self.sigma0_sq is None:
            return RoundPlan(devices)
        pool = devices if cfg.others_set == "active" else [d.device_id for d in fleet.devices]
        oracle = None
        if cfg.per_sample_variance is not None:
            v_sq = cfg.per_sample_variance
            oracle = {d.device_id: v_sq / max(d.num_train_samples, 1) for d in fleet.devices}
        known = impute_variances({k: self.table.get(k) for k in pool}, cfg.eps, oracle)
        s0 = self.sigma0_sq
        if known is None or any(not s0 + v > cfg.eps for v in known.values()):
            return RoundPlan(devices)
        s_minus = others_precision(s0, known, devices)
        scalars = {m: {SELFFL_SIGMA0_SQ: s0, SELFFL_S_MINUS: s_minus[m]} for m in devices}
        return RoundPlan(devices, scalars)

    def aggregate(
        self, round_id: int, shared: Tensors, updates: Sequence[ReceivedUpdate]
    ) -> Aggregate:
        """Eq. (14), Eq. (11) weights, smoothing; non-finite updates are dropped (§4.4)."""
        cfg = self.config
        kept = [u for u in updates if all(torch.isfinite(t).all() for t in u.shared_delta.values())]
        scalars: dict[str, float] = {"dropped": float(len(updates) - len(kept))}
        if not shared or not kept:
            return Aggregate(dict(shared), scalars)
        deltas = [u.shared_delta for u in kept]
        names = [
            name
            for name, value in deltas[0].items()
            if value.is_floating_point() and not any(fnmatch(name, p) for p in cfg.variance_exclude)
        ]
        estimate = trace_variance(deltas, names)
        sigma0_sq = cfg.sigma0_sq if cfg.sigma0_sq is not None else estimate
        lagged = self.sigma0_sq if cfg.lagged_sigma0 and self.sigma0_sq is not None else None
        reported = [u.scalars.get(SELFFL_SIGMA_M_SQ) for u in kept]
        weights, mode = self._weights(round_id, kept, sigma0_sq if lagged is None else lagged)
        shared_next = apply_delta(shared, weighted_mean(deltas, weights), self.beta)
        for update, value in zip(kept, reported, strict=True):
            if _valid(value, cfg.eps) and value is not None:
                self.table[update.device_id] = value
        self.sigma0_sq = sigma0_sq
        valid = [v for v in reported if v is not None and _valid(v, cfg.eps)]
        steps = [u.scalars[SELFFL_LOCAL_STEPS] for u in kept if SELFFL_LOCAL_STEPS in u.scalars]
        scalars.update(
            {
                "sigma0_sq": sigma0_sq,
                "sigma0_sq_estimate": estimate,
                "precision_weighted": 1.0 if mode == "precision" else 0.0,
                "weight_max": max(weights) / sum(weights),
                "smoothing_beta": self.beta,
                "reported_sigma_m_sq": float(len(valid)),
            }
        )
        if valid:
            scalars["sigma_m_sq_mean"] = math.fsum(valid) / len(valid)
        if steps:
            scalars["local_steps_mean"] = math.fsum(steps) / len(steps)
        return Aggregate(shared_next, scalars)

    def _weights(
        self, round_id: int, updates: Sequence[ReceivedUpdate], sigma0_sq: float
    ) -> tuple[list[float], str]:
        """Eq. (11) weights, or the warm-up / fallback weights of selffl.md §4.2 (A8)."""
        cfg = self.config
        if round_id <= cfg.warmup_rounds:
            return _plain_weights(updates, cfg.warmup_weights), "warmup"
        reported = {u.device_id: u.scalars.get(SELFFL_SIGMA_M_SQ) for u in updates}
        known = impute_variances(reported, cfg.eps) if cfg.uncertainty_weights else None
        if known is None or any(not sigma0_sq + v > 0 for v in known.values()):
            return _plain_weights(updates, cfg.fallback_weights), "fallback"
        return precision_weights(sigma0_sq, [known[u.device_id] for u in updates]), "precision"

    def state_dict(self) -> dict[str, object]:
        """sigma_0^2-hat and the sigma_k^2 table, JSON-able."""
        return {"sigma0_sq": self.sigma0_sq, "table": dict(self.table)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore `state_dict()`'s output."""
        sigma0 = state.get("sigma0_sq")
        self.sigma0_sq = float(sigma0) if isinstance(sigma0, int | float) else self.config.sigma0_sq
        table = state.get("table")
        self.table = (
            {str(k): float(v) for k, v in table.items()} if isinstance(table, Mapping) else {}
        )


class SelfFlAugStrategy(SelfFlStrategy):
    """Algorithm 2's server: the same rules on the uploaded local optima (Eqs. 22-23)."""

    name: ClassVar[str] = "selffl-aug"
    config_type: ClassVar[type[AlgorithmConfig]] = SelfFlAugConfig


def _plain_weights(updates: Sequence[ReceivedUpdate], kind: AggregationWeights) -> list[float]:
    """FedAvg's sample-count weights, or equal ones (the paper's "-e" baselines)."""
    return [1.0 if kind == "uniform" else float(max(u.num_samples, 1)) for u in updates]
