"""Client-level DP: accountant, clipping, calibrated noise, adaptive clipping, refusals.

The accountant is checked against published values and closed forms; the rest against the
equations of DP-FedAvg and Andrew et al. 2021 on data the tests make.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coordinator.run.settings import RunSettings
from coordinator.stages.accountant import RDP_ORDERS, DpRound, epsilon_of, rdp_epsilon_of
from coordinator.stages.compatibility import problem
from coordinator.stages.mechanisms import poisson_cohort
from coordinator.stages.privacy import PrivacyEngine
from coordinator.strategies import build_strategy
from coordinator.strategies.base import DeviceInfo, FleetSnapshot, ReceivedUpdate
from device_agent.algorithms.base import LocalResult
from device_agent.privacy import privatize
from protocols.algorithms import parse_algorithm_config
from protocols.messages import DevicePrivacy
from protocols.privacy import (
    PrivacySettings,
    clip_to_norm,
    next_clip_norm,
    update_noise_multiplier,
    update_norm,
)


@pytest.mark.parametrize(
    ("noise", "rate", "steps", "published"),
    [
        # Abadi et al. 2016, "Deep Learning with Differential Privacy", section 3.1.
        (4.0, 0.01, 10_000, 1.26),
        # Bu et al. 2020, "Deep Learning with Gaussian Differential Privacy", Figure 4: MNIST,
        # batch 256 of 60,000, 20 and 70 epochs, by the moments accountant.
        (1.3, 256 / 60_000, 4688, 1.34),
        (0.7, 256 / 60_000, 16_407, 8.68),
    ],
)
def test_epsilon_is_at_most_the_published_moments_accountant_value_and_close_to_it(
    noise: float, rate: float, steps: int, published: float
) -> None:
    """Never looser than the moments accountant those papers used, and within a quarter.

    RDP with the tight conversion to (epsilon, delta) improves on it; it must not be worse.
    """
    population = 60_000
    rounds = [DpRound(noise, population, rate * population)] * steps
    epsilon = epsilon_of(rounds, "poisson", 1e-5)
    assert 0.75 * published <= epsilon <= published


def test_full_participation_epsilon_is_the_closed_form_of_composed_gaussians() -> None:
    """Everyone each round: T Gaussians of multiplier z, in closed form.

    Their RDP is T alpha / (2 z^2); the conversion is
    eps = min_alpha RDP + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1).
    """
    z, rounds, delta = 3.0, 40, 1e-5
    closed = min(
        rounds * a / (2 * z * z) + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        for a in RDP_ORDERS
    )
    got = rdp_epsilon_of([DpRound(z, 100, 100.0)] * rounds, "poisson", delta)
    assert got == pytest.approx(closed, rel=1e-6)


def test_epsilon_grows_with_rounds_and_falls_with_noise_and_sampling() -> None:
    def eps(z: float, rate: float, t: int) -> float:
        return epsilon_of([DpRound(z, 1000, rate * 1000)] * t, "poisson", 1e-5)

    assert eps(1.0, 0.1, 10) < eps(1.0, 0.1, 20)
    assert eps(2.0, 0.1, 20) < eps(1.0, 0.1, 20)
    assert eps(1.0, 0.05, 20) < eps(1.0, 0.1, 20)
    assert epsilon_of([DpRound(0.0, 10, 5.0)], "poisson", 1e-5) == math.inf


def _result(delta: dict[str, torch.Tensor]) -> LocalResult:
    return LocalResult(delta, 120, 0.7, {"head.weight": torch.ones(2)}, {"sigma": 0.3})


def test_update_norm_is_the_norm_over_every_floating_tensor_and_skips_counters() -> None:
    # Prepare: several floating dtypes, an empty tensor, and an integer counter
    delta = {
        "w": torch.tensor([[1.0, -2.0], [0.5, 0.25]]),
        "h": torch.tensor([3.0], dtype=torch.float16),
        "b": torch.tensor([-4.0], dtype=torch.bfloat16),
        "d": torch.tensor([0.125], dtype=torch.float64),
        "empty": torch.zeros(0),
        "steps": torch.tensor([1000]),
    }
    expected = math.sqrt(1 + 4 + 0.25 + 0.0625 + 9 + 16 + 0.125**2)

    # Execute / Assert
    assert update_norm(delta) == pytest.approx(expected, rel=1e-15)
    assert update_norm({"steps": torch.tensor([5])}) == 0.0
    assert math.isnan(update_norm({"w": torch.tensor([1.0, math.nan])}))


def test_a_device_clips_its_delta_and_reports_no_loss_count_or_scalars() -> None:
    delta = {"w": torch.tensor([3.0, 0.0, 4.0]), "b": torch.tensor([12.0])}  # norm 13
    private, within = privatize(
        _result(delta), DevicePrivacy(clip_norm=1.0), torch.Generator().manual_seed(0)
    )
    assert update_norm(private.shared_delta) == pytest.approx(1.0)
    torch.testing.assert_close(private.shared_delta["b"], torch.tensor([12.0 / 13]))
    assert (private.num_samples, private.train_loss, private.scalars) == (1, 0.0, {})
    assert private.personal["head.weight"].sum() == 2  # personal parameters stay as trained
    assert within is None
    _, bit = privatize(
        _result({"w": torch.tensor([0.3])}),
        DevicePrivacy(clip_norm=1.0, report_clipped=True),
        torch.Generator().manual_seed(0),
    )
    assert bit == 0.5  # centred: +1/2 within the clip


def _engine(**options: object) -> PrivacyEngine:
    return PrivacyEngine(PrivacySettings(**options), participation=0.1, reproducible_seed=7)  # type: ignore[arg-type]


def _fleet(n: int) -> FleetSnapshot:
    return FleetSnapshot(tuple(DeviceInfo(f"dev-{i:04d}", 10, True) for i in range(n)))


def _updates(deltas: list[dict[str, torch.Tensor]]) -> list[ReceivedUpdate]:
    return [ReceivedUpdate(f"dev-{i:04d}", 50 + i, 0.5, d) for i, d in enumerate(deltas)]


def test_without_noise_the_fedavg_aggregate_is_the_clipped_sum_over_the_expected_cohort() -> None:
    engine = _engine(noise_multiplier=0.0, clip_norm=1.0)
    fleet = _fleet(40)  # participation 0.1: expected cohort 4
    engine.plan(fleet, ["dev-0000", "dev-0001", "dev-0002"])
    deltas = [
        {"w": torch.tensor([3.0, 4.0])},
        {"w": torch.tensor([0.1, 0.0])},
        {"w": -torch.ones(2)},
    ]
    strategy = build_strategy(parse_algorithm_config("fedavg", {}), 1.0)
    shared = {"w": torch.zeros(2)}
    aggregate = strategy.aggregate(1, shared, engine.privatize(_updates(deltas), shared))
    expected = sum(clip_to_norm(d, 1.0)["w"] for d in deltas) / 4
    torch.testing.assert_close(aggregate.shared["w"], expected)


def test_coordinator_noise_on_the_mean_has_variance_z_clip_over_cohort_squared() -> None:
    z, clip, n = 1.5, 2.0, 200_000
    engine = _engine(noise_multiplier=z, clip_norm=clip)
    engine.plan(_fleet(50), ["dev-0000", "dev-0001"])  # expected cohort 5
    private = engine.privatize(_updates([{"w": torch.zeros(n)}] * 2), {"w": torch.zeros(n)})
    total = sum(
        (u.shared_delta["w"].double() for u in private), torch.zeros(n, dtype=torch.float64)
    )
    mean = total / len(private)
    assert mean.var().item() == pytest.approx((z * clip / 5) ** 2, rel=0.02)
    assert abs(mean.mean().item()) < 5 * (z * clip / 5) / math.sqrt(n)


def test_device_noise_shares_sum_to_the_target_variance() -> None:
    z, clip, cohort, n = 1.0, 1.0, 8, 100_000
    engine = _engine(noise_multiplier=z, clip_norm=clip, placement="device")
    device = engine.plan(_fleet(80), [f"dev-{i:04d}" for i in range(cohort)])
    assert device.noise_std == pytest.approx(z * clip / math.sqrt(cohort))
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(cohort):
        private, _ = privatize(
            _result({"w": torch.zeros(n)}), device, torch.Generator().manual_seed(seed)
        )
        total += private.shared_delta["w"].double()
    assert total.var().item() == pytest.approx((z * clip) ** 2, rel=0.02)


def test_a_device_that_did_not_clip_is_clipped_by_the_coordinator() -> None:
    engine = _engine(noise_multiplier=0.0, clip_norm=1.0)
    engine.plan(_fleet(10), ["dev-0000"])  # expected cohort 1
    private = engine.privatize(_updates([{"w": torch.full((4,), 100.0)}]), {"w": torch.zeros(4)})
    assert update_norm(private[0].shared_delta) == pytest.approx(1.0)


def test_adaptive_clipping_follows_andrew_et_al() -> None:
    assert update_noise_multiplier(1.0, 5.0) == pytest.approx((1 - 1 / 100) ** -0.5)
    with pytest.raises(ValueError, match="no budget"):
        update_noise_multiplier(1.0, 0.4)
    assert next_clip_norm(1.0, 0.5, 0.5, 0.2) == 1.0
    assert next_clip_norm(1.0, 1.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1))  # all within: shrink
    assert next_clip_norm(1.0, 0.0, 0.5, 0.2) == pytest.approx(math.exp(0.1))  # none: grow


def test_adaptive_clip_moves_towards_the_update_norms_median() -> None:
    engine = _engine(
        noise_multiplier=1.0, clip_norm=1.0, adaptive_clipping=True, clip_learning_rate=0.5
    )
    fleet = _fleet(1000)  # expected cohort 100: the count's noise is 5
    devices = [f"dev-{i:04d}" for i in range(100)]
    for _ in range(60):
        engine.plan(fleet, devices)
        engine.privatize(_updates([{"w": torch.tensor([0.1])}] * 100), {"w": torch.zeros(1)})
        engine.finish([0.5 if engine.clip_norm >= 0.1 else -0.5] * 100)
    assert engine.clip_norm < 0.3  # every update norm 0.1: the median quantile is 0.1


# the round engine names its reporters (100) whether or not they were summed securely
@pytest.mark.parametrize("reporters", [None, 100])
def test_a_lying_within_clip_bit_counts_at_most_as_an_honest_one(reporters: int | None) -> None:
    settings = {"noise_multiplier": 1.0, "adaptive_clipping": True, "placement": "device"}
    honest, lying = _engine(**settings), _engine(**settings)
    fleet, devices = _fleet(1000), [f"dev-{i:04d}" for i in range(100)]
    device = honest.plan(fleet, devices)
    lying.plan(fleet, devices)
    ceiling = 0.5 + 8 * device.indicator_std
    fair = honest.finish([0.5] * 99 + [ceiling], reporters=reporters)["dp_within_clip"]
    lie = lying.finish([0.5] * 99 + [1e6], reporters=reporters)["dp_within_clip"]
    assert lie == pytest.approx(fair)


def test_poisson_cohort_keeps_each_device_with_the_sampling_rate() -> None:
    rng = np.random.default_rng(0)
    sizes = [len(poisson_cohort(_fleet(1000), 0.1, rng).online()) for _ in range(50)]
    assert 90 < sum(sizes) / 50 < 110
    assert len(set(sizes)) > 5  # the cohort's size varies, as Poisson sampling's does


def test_an_empty_poisson_draw_is_kept_not_drawn_again() -> None:
    """3 devices at rate 1/2: nobody is drawn with probability 1/8 (about 125 of 1000)."""
    rng = np.random.default_rng(0)
    empty = sum(not poisson_cohort(_fleet(3), 0.5, rng).online() for _ in range(1000))
    assert 90 < empty < 160


@pytest.mark.parametrize("placement", ["coordinator", "device"])
def test_a_round_that_sampled_nobody_releases_the_noise_alone_and_counts(placement: str) -> None:
    """The noised sum of nobody's updates, accounted at z like any other round.

    xi / m, with xi ~ N(0, (zC)^2) added here even when devices add the noise (none did).
    """
    z, clip, n = 1.5, 2.0, 200_000
    engine = _engine(noise_multiplier=z, clip_norm=clip, placement=placement)
    fleet = _fleet(50)  # participation 0.1: expected cohort 5
    assert engine.releases_empty(fleet)
    engine.plan(fleet, [])
    (released,) = engine.privatize([], {"w": torch.zeros(n), "steps": torch.tensor([7])})
    assert released.shared_delta["w"].double().std().item() == pytest.approx(z * clip / 5, rel=0.01)
    assert released.shared_delta["steps"].item() == 0  # counters get no noise, and nobody counted
    scalars = engine.finish([], reporters=0)
    assert scalars["dp_noise_multiplier"] == z
    assert scalars["dp_epsilon"] == pytest.approx(
        epsilon_of([DpRound(z, 50, 5.0)], "poisson", 1e-5)
    )
    assert not _engine(sampling="fixed").releases_empty(fleet)  # a fixed size is never empty


@pytest.mark.parametrize(
    ("algorithm", "options", "reason"),
    [
        ("selffl", {}, "uncertainty"),
        ("federico", {}, "relays"),
        ("local", {}, "nothing to protect"),
        ("fedavg", {"robust_aggregation": "median"}, "not a sum"),
        ("fedprox", {"robust_aggregation": "centered-clipping"}, "not a sum"),
        ("fedavg", {"clip_update_norm": 1.0}, "replaces clip_update_norm"),
        ("pfedbred", {"train_all_clients": True}, "outside the sampled cohort"),
    ],
)
def test_algorithms_that_cannot_run_under_dp_say_why(
    algorithm: str, options: dict[str, object], reason: str
) -> None:
    refused = problem(
        RunSettings.load(None, dp_noise=1.0), [parse_algorithm_config(algorithm, options)]
    )
    assert refused is not None
    assert refused.startswith("differential privacy: ")
    assert reason in refused


@pytest.mark.parametrize(
    "algorithm",
    ["fedavg", "fedprox", "fedavg-ft", "fedalt", "fedsim", "ditto", "pfedme", "pfedbred"],
)
def test_sum_based_algorithms_run_under_dp(algorithm: str) -> None:
    assert (
        problem(RunSettings.load(None, dp_noise=1.0), [parse_algorithm_config(algorithm, {})])
        is None
    )
