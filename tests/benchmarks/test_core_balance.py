"""benchmarks/core_balance.py: the cost of an even split, against closed forms."""

from __future__ import annotations

import pytest

from benchmarks.core_balance import cpu_jiffies, split_efficiency, stolen_share


def test_equal_steady_cores_lose_nothing() -> None:
    assert split_efficiency([100] * 40, [100] * 40, 0.25, 0.5) == pytest.approx(1.0)


@pytest.mark.parametrize(("fast", "slow"), [(100, 50), (90, 60), (100, 99)])
def test_steady_unequal_cores_get_twice_the_slower_over_the_sum(fast: int, slow: int) -> None:
    # each core does half of every round: the slower one sets its length
    efficiency = split_efficiency([fast] * 80, [slow] * 80, 0.25, 1.0)
    assert efficiency == pytest.approx(2 * slow / (fast + slow), rel=1e-9)


def test_swings_shorter_than_a_round_average_out_and_longer_ones_do_not() -> None:
    # the cores take turns being 50% slower, every second (4 windows)
    first = ([100] * 4 + [50] * 4) * 20
    second = ([50] * 4 + [100] * 4) * 20
    long_rounds = split_efficiency(first, second, 0.25, 8.0)
    short_rounds = split_efficiency(first, second, 0.25, 0.25)
    assert long_rounds == pytest.approx(1.0, abs=0.02)
    assert short_rounds < 0.8


@pytest.mark.parametrize(
    ("first", "second", "round_s"),
    [([1, 2], [1], 0.1), ([1, 0], [1, 1], 0.1), ([], [], 0.1), ([5] * 4, [5] * 4, 2.0)],
)
def test_unusable_series_are_refused(first: list[int], second: list[int], round_s: float) -> None:
    with pytest.raises(ValueError, match=r"series|does not fit"):
        split_efficiency(first, second, 0.25, round_s)


def test_the_stolen_share_is_the_steal_difference_over_the_total_difference() -> None:
    assert stolen_share((10, 1000), (60, 2000)) == "5.0%"
    assert stolen_share(None, (60, 2000)) == "unknown"
    assert stolen_share((10, 1000), (10, 1000)) == "unknown"  # no time passed
    reading = cpu_jiffies()
    if reading is not None:  # Linux: steal is part of the total
        assert 0 <= reading[0] <= reading[1]
