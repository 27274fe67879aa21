"""The aggregate guard: capped weight shares, median-relative norm clips, no bad aggregate applied.

Closed forms, and a FedAvg round with one lying device.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.stages.aggregate_guard import (
    GuardSettings,
    aggregate_problem,
    cap_counts,
    cap_shares,
    count_limit,
    guarded_aggregate,
    lower_median,
    screen,
)
from coordinator.strategies.base import ReceivedUpdate
from coordinator.strategies.fedavg import FedAvgStrategy
from protocols.algorithms import FedAvgConfig

SHARED = {"w": torch.zeros(4)}


def _update(device: str, samples: int, value: float) -> ReceivedUpdate:
    return ReceivedUpdate(device, samples, 0.0, {"w": torch.full((4,), value)})


@pytest.mark.parametrize(
    ("counts", "share", "expected"),
    [
        ((100, 10**12), 0.5, [100, 100]),  # two devices: equal at most
        ((1, 1, 1, 1000), 0.5, [1, 1, 1, 3]),  # T = 0.5 (3 + T)
        ((10, 20, 30, 40), 0.5, [10, 20, 30, 40]),  # honest counts under the cap are untouched
        ((5, 10**9), 1.0, [5, 10**9]),  # 1 disables
        ((10**9,), 0.5, [10**9]),  # one device is the whole round
        ((3, 5, 10**6), 0.2, [3, 3, 3]),  # 3 devices cannot each be under 20%: all equal
        ((0, 7, 10**6), 0.5, [0, 7, 7]),
    ],
)
def test_cap_shares(counts: tuple[int, ...], share: float, expected: list[int]) -> None:
    capped = cap_shares(counts, share)
    assert capped == expected
    positive = [c for c in capped if c > 0]
    if len(positive) * share > 1:
        assert max(capped) <= share * sum(capped) + 1


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ((10, 10, 10, 10, 10**6), 30.0),  # similar counts: 3 x the median
        ((10, 20, 40, 80, 160), 40 * 4.0**4),  # Q1 20, median 40, Q3 80: (80 / 20) ** 4 x 40
        ((60,) * 18 + (10**6,) * 2, 180.0),  # two liars of 20 move neither Q3 nor the median
        ((5,), float("inf")),  # one count: nothing to compare with
    ],
)
def test_count_limit(counts: tuple[int, ...], expected: float) -> None:
    assert count_limit(counts, 3.0, 4.0) == expected


def test_colluding_liars_weigh_at_most_k_f_over_k_f_plus_1_minus_f() -> None:
    """Two free riders of 20 declaring 10^6 each: 3 x 0.1 / (3 x 0.1 + 0.9) = 1/4 of the round."""
    capped = cap_counts([60] * 18 + [10**6] * 2, 3.0, 4.0)
    assert capped == [60] * 18 + [180] * 2
    assert sum(capped[18:]) / sum(capped) == pytest.approx(3 * 0.1 / (3 * 0.1 + 0.9))
    assert cap_counts([60] * 18 + [10**6] * 2, 0.0, 4.0)[18:] == [10**6] * 2  # 0 disables


def test_a_heavy_tailed_honest_fleet_keeps_its_large_devices() -> None:
    """Log-normal sizes (the synthetic task's first fleet of 20): the spread widens the limit."""
    counts = [34, 36, 37, 37, 44, 44, 45, 48, 48, 50, 53, 64, 69, 83, 100, 210, 266, 650, 650, 650]
    assert cap_counts(counts, 3.0, 4.0) == counts  # 650 is 13x the median, the limit 26.7x
    assert max(cap_counts(counts, 3.0, 0.0)) == 3 * 50  # without the spread term it would cap


def test_the_screen_caps_free_riders_counts_before_the_shares() -> None:
    honest = [_update(f"d{i:02}", 60, 1.0) for i in range(18)]
    riders = [_update(f"r{i}", 10**6, 0.0) for i in range(2)]
    screened = screen([*honest, *riders], GuardSettings())
    assert [u.num_samples for u in screened.updates] == [60] * 18 + [180] * 2
    assert set(screened.cut) == {"r0", "r1"}
    assert "capped from 1000000 to 180" in screened.cut["r0"]


def test_the_lower_median_ignores_one_huge_value() -> None:
    assert lower_median([1.0, 1e30]) == 1.0
    assert lower_median([3.0, 1.0, 2.0]) == 2.0


def test_screen_clips_an_outlier_to_the_bound_and_leaves_the_rest() -> None:
    updates = [_update("a", 10, 1.0), _update("b", 10, 2.0), _update("evil", 10, 1e6)]
    screened = screen(updates, GuardSettings(norm_bound=10.0))
    norms = [float(u.shared_delta["w"].norm()) for u in screened.updates]
    assert norms[:2] == pytest.approx([2.0, 4.0])
    assert norms[2] == pytest.approx(10 * 4.0)  # 10 x the lower median norm (b's)
    assert list(screened.cut) == ["evil"]


def test_an_aggregate_that_is_not_finite_or_explodes_is_a_problem() -> None:
    assert aggregate_problem(SHARED, {"w": torch.ones(4)}, 1000.0) == ""
    assert "not finite" in aggregate_problem(
        SHARED, {"w": torch.tensor([1.0, float("inf"), 0, 0])}, 1e3
    )
    assert "moves the model" in aggregate_problem(SHARED, {"w": torch.full((4,), 1e6)}, 1000.0)


def test_a_lying_device_moves_fedavg_no_further_than_the_documented_bound() -> None:
    honest = [_update(f"d{i}", 100, 1.0) for i in range(4)]
    evil = _update("evil", 10**12, 1e20)
    strategy = FedAvgStrategy(FedAvgConfig(), participation=1.0)
    guarded = guarded_aggregate(strategy, 1, SHARED, [*honest, evil], GuardSettings())
    assert guarded.aggregate is not None
    assert set(guarded.cut) == {"evil"}
    # docs/security.md's bound: share x (norm_bound + 1) x the round's lower median norm
    settings = GuardSettings()
    moved = float((guarded.aggregate.shared["w"] - torch.ones(4)).norm())
    assert moved <= settings.max_weight_share * (settings.norm_bound + 1) * 2.0
    assert moved > 1.0  # the bound is what is promised, not that the lie is ignored


def test_with_the_screen_off_a_rejected_aggregate_is_skipped_and_the_state_restored() -> None:
    strategy = FedAvgStrategy(FedAvgConfig(server_optimizer="fedadam", server_lr=0.1), 1.0)
    strategy.aggregate(1, SHARED, [_update("a", 10, 0.5)])  # some Adam state to keep
    before = strategy.state_dict()
    settings = GuardSettings(max_weight_share=1.0, norm_bound=0.0, max_growth=1e-6)
    guarded = guarded_aggregate(strategy, 2, SHARED, [_update("a", 10, 1.0)], settings)
    assert guarded.aggregate is None
    assert "moves the model" in guarded.rejected
    assert strategy.state_dict() == before
