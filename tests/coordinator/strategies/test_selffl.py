"""Self-FL's coordinator half: Eq. (14), Eq. (11) weights, S_{-m}, smoothing, fallbacks."""

import numpy as np
import pytest
import torch

from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from coordinator.strategies.selffl import (
    SelfFlStrategy,
    impute_variances,
    others_precision,
    precision_weights,
    trace_variance,
)
from protocols.algorithms import SelfFlConfig

from .random_updates import random_updates

SHAPES = {"w": (3, 2), "b": (2,)}


def _with_sigma(updates: list[ReceivedUpdate], sigmas: list[float | None]) -> list[ReceivedUpdate]:
    return [
        ReceivedUpdate(
            u.device_id,
            u.num_samples,
            u.train_loss,
            u.shared_delta,
            {} if s is None else {"sigma_m_sq": s, "local_steps": 4.0},
        )
        for u, s in zip(updates, sigmas, strict=True)
    ]


def _fleet(counts: list[int]) -> FleetSnapshot:
    return FleetSnapshot(tuple(DeviceInfo(f"dev-{i}", n, True) for i, n in enumerate(counts)))


def _flat(delta) -> np.ndarray:
    return np.concatenate([delta[n].double().numpy().reshape(-1) for n in sorted(delta)])


def test_trace_variance_is_eq14_and_shift_invariant() -> None:
    # spec §7 oracle 5: on deltas as on models
    rng = np.random.default_rng(0)
    updates = random_updates(rng, [5, 9, 2, 7], SHAPES)
    deltas = [u.shared_delta for u in updates]
    flat = np.stack([_flat(d) for d in deltas])
    expected = float(((flat - flat.mean(axis=0)) ** 2).sum() / 4)
    assert trace_variance(deltas, ["w", "b"]) == pytest.approx(expected)
    global_model = {"w": torch.full((3, 2), 3.0), "b": torch.tensor([-1.0, 2.0])}
    models = [{n: global_model[n] + d[n] for n in d} for d in deltas]
    assert trace_variance(models, ["w", "b"]) == pytest.approx(expected, rel=1e-6)
    assert trace_variance(deltas[:1], ["w", "b"]) == 0.0


def test_precision_weights_and_extremes() -> None:
    # Eq. (11); spec §7 oracle 6: sigma0 -> inf gives equal weights; sigma0 = 0 gives 1/sigma_m^2
    sig = [0.1, 0.4, 0.2]
    w = precision_weights(0.3, sig)
    raw = np.array([1 / 0.4, 1 / 0.7, 1 / 0.5])
    assert w == pytest.approx((raw / raw.sum()).tolist())
    assert precision_weights(1e12, sig) == pytest.approx([1 / 3] * 3)
    inv = np.array([10.0, 2.5, 5.0])
    assert precision_weights(0.0, sig) == pytest.approx((inv / inv.sum()).tolist())
    with pytest.raises(ValueError, match="positive finite"):
        precision_weights(0.0, [0.0, 1.0])


def test_others_precision_excludes_the_device_itself() -> None:
    s = others_precision(0.5, {"a": 0.5, "b": 1.5, "c": 0.0}, ["a", "c", "z"])
    assert s["a"] == pytest.approx(1 / 2 + 1 / 0.5)
    assert s["c"] == pytest.approx(1 / 1 + 1 / 2)
    assert s["z"] == pytest.approx(1 + 0.5 + 2)


def test_impute_variances() -> None:
    assert impute_variances({"a": 0.2, "b": None, "c": 0.4}, 1e-12) == {
        "a": 0.2,
        "b": pytest.approx(0.3),
        "c": 0.4,
    }
    assert impute_variances({"a": 0.2, "b": None}, 1e-12, {"b": 0.9}) == {"a": 0.2, "b": 0.9}
    assert impute_variances({"a": None, "b": 0.0}, 1e-12) is None


def test_aggregate_uses_precision_weights_and_smoothing() -> None:
    # Prepare: unequal sample counts and variances; C = 0.5, so beta = 0.5
    rng = np.random.default_rng(1)
    updates = _with_sigma(random_updates(rng, [5, 50, 9], SHAPES), [0.2, 0.05, None])
    strategy = build_strategy(SelfFlConfig(), 0.5)
    assert isinstance(strategy, SelfFlStrategy)
    shared = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    # Execute
    result = strategy.aggregate(1, shared, updates)
    # Assert: sigma0 by Eq. 14; the missing sigma imputed with the mean 0.125
    deltas = [u.shared_delta for u in updates]
    s0 = trace_variance(deltas, ["w", "b"])
    raw = 1 / (s0 + np.array([0.2, 0.05, 0.125]))
    alpha = raw / raw.sum()
    mean = sum(a * _flat(d) for a, d in zip(alpha, deltas, strict=True))
    assert _flat(result.shared) == pytest.approx(_flat(shared) + 0.5 * mean, abs=1e-6)
    assert result.scalars["sigma0_sq"] == pytest.approx(s0)
    assert result.scalars["precision_weighted"] == 1.0
    assert result.scalars["local_steps_mean"] == 4.0
    assert strategy.table == {"dev-0": 0.2, "dev-1": 0.05}
    # ... and not FedAvg's sample weighting
    fedavg = sum(n * _flat(d) for n, d in zip([5, 50, 9], deltas, strict=True)) / 64
    assert not np.allclose(_flat(result.shared), _flat(shared) + 0.5 * fedavg, atol=1e-3)


@pytest.mark.parametrize(
    ("round_id", "sigmas", "fallback", "expected"),
    [
        (1, [0.2, 0.1], "uniform", [5, 50]),  # warm-up: FedAvg sample weights
        (3, [None, None], "uniform", [1, 1]),  # nothing valid: fallback
        (3, [None, 0.0], "samples", [5, 50]),
    ],
)
def test_warmup_and_fallback_weights(round_id, sigmas, fallback, expected) -> None:
    rng = np.random.default_rng(2)
    updates = _with_sigma(random_updates(rng, [5, 50], SHAPES), sigmas)
    config = SelfFlConfig(warmup_rounds=2, fallback_weights=fallback, smoothing_beta=1.0)
    result = SelfFlStrategy(config, 1.0).aggregate(
        round_id, {"w": torch.zeros(3, 2), "b": torch.zeros(2)}, updates
    )
    e = np.array(expected, dtype=float) / sum(expected)
    mean = sum(a * _flat(u.shared_delta) for a, u in zip(e, updates, strict=True))
    assert _flat(result.shared) == pytest.approx(mean, abs=1e-6)
    assert result.scalars["precision_weighted"] == 0.0


def test_non_finite_updates_are_dropped() -> None:
    rng = np.random.default_rng(3)
    updates = _with_sigma(random_updates(rng, [5, 6], SHAPES), [0.1, 0.2])
    bad = updates[1].shared_delta | {"b": torch.tensor([np.nan, 0.0])}
    updates[1] = ReceivedUpdate("dev-1", 6, 1.0, bad, {"sigma_m_sq": 0.2})
    strategy = SelfFlStrategy(SelfFlConfig(), 1.0)
    result = strategy.aggregate(2, {"w": torch.zeros(3, 2), "b": torch.zeros(2)}, updates)
    assert _flat(result.shared) == pytest.approx(_flat(updates[0].shared_delta), abs=1e-6)
    assert result.scalars["dropped"] == 1.0
    assert strategy.table == {"dev-0": 0.1}
    assert all(np.isfinite(_flat(result.shared)))


def test_plan_sends_sigma0_and_s_minus_once_known() -> None:
    # Prepare: table knows dev-0 and dev-2; dev-1 and dev-3 are imputed with the mean
    strategy = SelfFlStrategy(SelfFlConfig(), 1.0)
    fleet = _fleet([10, 20, 30, 40])
    rng = np.random.default_rng(0)
    assert strategy.plan_round(1, fleet, rng).scalars == {}  # nothing known yet: fallback
    strategy.sigma0_sq, strategy.table = 0.5, {"dev-0": 0.1, "dev-2": 0.3}
    # Execute
    plan = strategy.plan_round(2, fleet, rng)
    # Assert: S_{-m} over the 3 other registered devices
    precision = {"dev-0": 1 / 0.6, "dev-1": 1 / 0.7, "dev-2": 1 / 0.8, "dev-3": 1 / 0.7}
    for device in plan.devices:
        expected = sum(v for k, v in precision.items() if k != device)
        assert plan.scalars[device]["s_minus"] == pytest.approx(expected)
        assert plan.scalars[device]["sigma0_sq"] == 0.5
    # others_set="active" sums over the round's other devices only; oracle fills unknowns
    active = SelfFlStrategy(SelfFlConfig(others_set="active", per_sample_variance=2.0), 0.5)
    active.sigma0_sq = 0.5
    plan = active.plan_round(2, fleet, rng)
    assert len(plan.devices) == 2
    a, b = plan.devices
    n = {"dev-0": 10, "dev-1": 20, "dev-2": 30, "dev-3": 40}
    assert plan.scalars[a]["s_minus"] == pytest.approx(1 / (0.5 + 2.0 / n[b]))


def test_state_round_trips_through_json() -> None:
    import json

    strategy = SelfFlStrategy(SelfFlConfig(), 1.0)
    strategy.sigma0_sq, strategy.table = 0.25, {"dev-0": 0.1}
    restored = SelfFlStrategy(SelfFlConfig(), 1.0)
    restored.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    assert restored.sigma0_sq == 0.25
    assert restored.table == {"dev-0": 0.1}
