"""benchmarks/simulation_scale.py: how the spread of back-to-back runs is reported."""

from __future__ import annotations

import pytest

from benchmarks.simulation_scale import paired_range


def test_range_pairs_each_run_with_the_one_made_beside_it() -> None:
    # medians alone would give 5.0 / 2.5 = 2.00x; the pairs are 2.50x and 1.20x
    assert paired_range([5.0, 6.0, 4.0], [2.0, 5.0, 2.5]) == "1.20-2.50x"


def test_one_pair_is_a_range_of_one_figure() -> None:
    assert paired_range([3.0], [2.0]) == "1.50-1.50x"


def test_runs_left_unpaired_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"shorter|longer"):
        paired_range([3.0, 4.0], [2.0])
