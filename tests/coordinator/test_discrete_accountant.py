"""The distributed discrete Gaussian's accounting: Theorem 1, sampling, dropouts, settings."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from coordinator.stages.accountant import RDP_ORDERS, DpRound, epsilons_of, noise_for_epsilon
from coordinator.stages.discrete_accountant import (
    RingRound,
    poisson_subsampled,
    ring_noise_for_epsilon,
    ring_rdp,
)
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.secure.retry import SkippedRound, account_skipped
from coordinator.strategies.base import DeviceInfo, FleetSnapshot
from device_agent.algorithms.base import LocalResult
from device_agent.privacy import privatize
from protocols import secure_aggregation as sa
from protocols.messages import DevicePrivacy, SecureRound
from protocols.privacy import PrivacySettings, clip_to_norm


def _paper_epsilon(clip: float, gamma: float, share: float, n: int, d: int, shift: float) -> float:
    """Theorem 1 of Kairouz, Liu and Steinke 2021 in the delta's units (granularity gamma)."""
    first = (clip + gamma * math.sqrt(d)) ** 2
    second = (
        clip**2
        + gamma**2 * d / 4
        + math.sqrt(2 * math.log(1 / math.exp(-0.5))) * gamma * (clip + gamma * math.sqrt(d) / 2)
    )
    sensitivity = shift * math.sqrt(min(first, second))
    tau = 10 * sum(
        math.exp(-2 * math.pi**2 * (share / gamma) ** 2 * k / (k + 1)) for k in range(1, n)
    )
    return sensitivity / (math.sqrt(n) * share) + tau * math.sqrt(d)


@pytest.mark.parametrize(
    ("clip", "gamma", "share", "n", "d"),
    [(1.0, 0.5, 0.4, 5, 100), (1.0, 1e-3, 0.3, 10, 5000), (2.0, 1e-6, 0.5, 3, 10**5)],
)
def test_the_round_epsilon_is_theorem_1s_with_the_rounding_bound_and_tau(
    clip: float, gamma: float, share: float, n: int, d: int
) -> None:
    ring = RingRound.of(clip, 1 / gamma, share, n, d)
    for shift in (1, 2):
        paper = _paper_epsilon(clip, gamma, share, n, d, shift)
        assert ring.epsilon(shift) == pytest.approx(paper, rel=1e-9)
    assert ring.epsilon() > clip / (math.sqrt(n) * share)  # rounding and tau only add


def test_tau_matters_only_on_a_coarse_grid() -> None:
    coarse = RingRound.of(1.0, 2.0, 0.4, 5, 100)  # a device's share is 0.8 grid steps
    fine = RingRound.of(1.0, 1e4, 0.4, 5, 100)
    assert coarse.tau > 1e-6
    assert fine.tau == 0.0


def test_unsampled_rounds_are_rho_zcdp_and_replace_one_doubles_the_shift() -> None:
    ring = RingRound.of(1.0, 1e3, 0.5, 4, 1000)
    for sampling, shift in (("poisson", 1), ("fixed", 2)):
        rho = ring.epsilon(shift) ** 2 / 2
        expected = rdp.compute_epsilon(RDP_ORDERS, [rho * a for a in RDP_ORDERS], 1e-5)[0]
        spent = DpRound(1 / ring.epsilon(), 4, 4.0, ring)  # the whole population: no sampling
        got = epsilons_of([spent] * 3, sampling, 1e-5)  # type: ignore[arg-type]
        assert got.pld is None  # no PLD of a sum of discrete Gaussians
        three = rdp.compute_epsilon(RDP_ORDERS, [3 * rho * a for a in RDP_ORDERS], 1e-5)[0]
        assert got.rdp == pytest.approx(three, rel=1e-9)
        assert expected < three


def _zhu_wang(order: int, q: float, rho: float) -> float:
    """Zhu and Wang 2019, Theorem 5, term by term in plain floats (small orders only)."""
    total = (1 - q) ** (order - 1) * (order * q - q + 1)
    total += math.comb(order, 2) * q**2 * (1 - q) ** (order - 2) * math.exp(2 * rho)
    for level in range(3, order + 1):
        total += (
            3
            * math.comb(order, level)
            * q**level
            * (1 - q) ** (order - level)
            * math.exp((level - 1) * rho * level)
        )
    return math.log(total) / (order - 1)


@pytest.mark.parametrize(("q", "rho"), [(0.05, 0.5), (0.2, 0.1), (0.01, 2.0)])
def test_poisson_sampling_is_zhu_and_wangs_general_bound(q: float, rho: float) -> None:
    for order in range(2, 16):
        assert poisson_subsampled(order, q, rho) == pytest.approx(
            _zhu_wang(order, q, rho), rel=1e-9
        )


def test_the_general_bound_is_above_the_gaussian_specific_one_and_below_no_sampling() -> None:
    ring = RingRound(1.0, 1.0, 1, 0)  # eps 1: the Gaussian of multiplier 1 at every order
    orders = [float(a) for a in range(2, 40)]
    sampled = ring_rdp(ring, 0.05, 1, orders)
    gaussian = rdp.RdpAccountant(orders)
    gaussian.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1)))
    assert np.all(sampled >= np.asarray(gaussian._rdp) * (1 - 1e-9))
    assert np.all(sampled <= np.asarray(orders) / 2 + 1e-12)


def _fleet(n: int) -> FleetSnapshot:
    return FleetSnapshot(tuple(DeviceInfo(f"dev-{i:04d}", 10, True) for i in range(n)))


def _engine(sampling: str = "poisson") -> PrivacyEngine:
    settings = PrivacySettings(
        noise_multiplier=1.0,
        clip_norm=1.0,
        placement="device",
        sampling=sampling,  # type: ignore[arg-type]
        distribution="discrete-gaussian",
    )
    return PrivacyEngine(settings, participation=0.1, reproducible_seed=7)


def _secure(device: DevicePrivacy, cohort: int) -> SecureRound:
    return SecureRound(
        threshold=0.6,
        cohort=cohort,
        min_survivors=3,
        clip_norm=device.clip_norm,
        value_bound=device.clip_norm + 8 * device.noise_std,
    )


@pytest.mark.parametrize("survivors", [10, 7, 4])
def test_the_accountant_counts_the_shares_of_the_survivors_only(survivors: int) -> None:
    engine = _engine()
    selected = [f"dev-{i:04d}" for i in range(10)]
    device = engine.plan(_fleet(100), selected)  # expected cohort 0.1 * 100 = 10
    assert device.discrete
    assert device.noise_std == pytest.approx(1.0 / math.sqrt(10))
    secure = _secure(device, 10)
    engine.ring(secure, 5000)
    scalars = engine.finish([None], reporters=survivors)
    spent = engine.accountant.rounds[-1]
    gamma = 1 / sa.delta_scale(secure)
    paper = _paper_epsilon(1.0, gamma, device.noise_std, survivors, 5000, 1)
    assert spent.ring is not None
    assert spent.ring.devices == survivors
    assert spent.ring.epsilon() == pytest.approx(paper, rel=1e-9)
    # the effective multiplier: z sqrt(k/m), less the rounding's (tiny on a 32-bit grid)
    assert scalars["dp_noise_multiplier"] == pytest.approx(math.sqrt(survivors / 10), rel=1e-4)
    assert scalars["dp_noise_multiplier"] < math.sqrt(survivors / 10)
    assert "dp_epsilon_pld" not in scalars
    rho = paper**2 / 2
    orders = [a for a in RDP_ORDERS if float(a).is_integer()]
    curve = [min(rho * a, _zhu_wang(int(a), 0.1, rho)) if a <= 24 else rho * a for a in orders]
    independent = rdp.compute_epsilon(orders, curve, 1e-5)[0]
    assert scalars["dp_epsilon"] <= independent * (1 + 1e-9)  # more orders can only lower it
    assert scalars["dp_epsilon"] == pytest.approx(independent, rel=0.02)


def test_a_dropout_costs_epsilon() -> None:
    spent = {}
    for survivors in (10, 5):
        engine = _engine()
        device = engine.plan(_fleet(100), [f"dev-{i:04d}" for i in range(10)])
        engine.ring(_secure(device, 10), 1000)
        spent[survivors] = engine.finish([None], reporters=survivors)["dp_epsilon"]
    assert spent[5] > spent[10] * 1.2


def test_the_discrete_gaussian_needs_device_placement_and_a_fixed_clip() -> None:
    with pytest.raises(ValueError, match="placement device"):
        PrivacySettings(distribution="discrete-gaussian")
    with pytest.raises(ValueError, match="adaptive clipping"):
        PrivacySettings(
            distribution="discrete-gaussian", placement="device", adaptive_clipping=True
        )


def test_under_the_discrete_gaussian_a_device_only_clips_before_the_ring() -> None:
    delta = {"w": torch.randn(100, generator=torch.Generator().manual_seed(0))}
    device = DevicePrivacy(clip_norm=1.0, noise_std=0.5, discrete=True)
    result = LocalResult(shared_delta=delta, num_samples=5, train_loss=0.3, personal={})
    private, _ = privatize(result, device, torch.Generator().manual_seed(1))
    assert torch.equal(private.shared_delta["w"], clip_to_norm(delta, 1.0)["w"])


def test_the_planned_noise_spends_the_target_and_more_than_the_gaussian_needs() -> None:
    z = ring_noise_for_epsilon(4.0, 1e-5, 0.1, 30, RDP_ORDERS)
    curve = 30 * ring_rdp(RingRound(1.0, z, 1, 0), 0.1, 1, RDP_ORDERS)
    assert rdp.compute_epsilon(RDP_ORDERS, curve, 1e-5)[0] == pytest.approx(4.0, abs=1e-3)
    assert z > noise_for_epsilon(4.0, 1e-5, "poisson", 0.1, 30)  # the general bound costs


def test_a_refused_sum_is_counted_with_the_discrete_noise_of_the_devices_in_it() -> None:
    engine = _engine()
    device = engine.plan(_fleet(100), [f"dev-{i:04d}" for i in range(10)])
    engine.ring(_secure(device, 10), 1000)
    skipped = SkippedRound("a sum out of range", 1, unmasked=6, excluded=())
    account_skipped(engine, skipped, population=100, selected=10)
    spent = engine.accountant.rounds[-1]
    assert spent.ring is not None
    assert spent.ring.devices == 6


def test_the_budget_looks_ahead_with_the_discrete_bound_not_the_gaussians() -> None:
    gaussian = epsilons_of([DpRound(1.0, 100, 10.0)], "poisson", 1e-5).tighter
    ring = RingRound(1.0, 1 / math.sqrt(10), 10, 0)
    discrete = epsilons_of([DpRound(1.0, 100, 10.0, ring)], "poisson", 1e-5).rdp
    assert gaussian < discrete
    settings = PrivacySettings(
        noise_multiplier=1.0,
        placement="device",
        distribution="discrete-gaussian",
        target_epsilon=(gaussian + discrete) / 2,
    )
    engine = PrivacyEngine(settings, participation=0.1, reproducible_seed=7)
    assert "over the budget" in engine.over_budget(100)
