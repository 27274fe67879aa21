"""The aggregate guard: capped weight shares, median-relative norm clips, no bad aggregate applied.

Closed forms, and a FedAvg round with one lying device.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.aggregate_guard import (
    GuardSettings,
    aggregate_problem,
    cap_shares,
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
