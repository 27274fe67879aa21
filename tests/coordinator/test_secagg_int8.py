"""Secure aggregation with int8 uplink: the model within one level, fewer bytes up, and DP."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from protocols.secure_levels import LEVELS, level_bits, packed_size

pytestmark = pytest.mark.slow
BASE = {"task": "digits", "devices": 12, "seed": 2, "workers": 1, "secagg": True}


def _run(**options: Any) -> SimulationResult:
    return run_simulation(SimulationSettings.load(None, **{**BASE, **options}))


def test_int8_levels_train_the_model_within_one_step_and_send_fewer_bytes() -> None:
    # Prepare: one round, uniform weights (weight bound 1), so the step is clip / 127
    options = {
        "rounds": 1,
        "secagg_clip": 1.0,
        "algorithm_options": {"aggregation_weights": "uniform"},
    }
    # Execute
    ring, levels = _run(**options), _run(**options, compress="int8")
    # Assert: the mean of 12 devices' levels errs by under one level per entry
    step = 1.0 / LEVELS
    differences = [
        float((levels.final_shared[name] - tensor).abs().max())
        for name, tensor in ring.final_shared.items()
    ]
    assert 0 < max(differences) <= step * (1 + 1e-6)
    assert levels.records[0].scalars["secagg_survivors"] == 12
    # each device's masked delta: 32 bits an entry before, level_bits(12) = 12 bits now
    entries = sum(tensor.numel() for tensor in ring.final_shared.values())
    saved = 12 * (4 * entries - packed_size(entries, level_bits(12)))
    measured = ring.records[0].bytes_up - levels.records[0].bytes_up
    assert measured == pytest.approx(saved, rel=0.01)


def test_coordinator_placed_dp_on_levels_spends_the_same_epsilon() -> None:
    # The levels keep the clip norm: the sensitivity, and so the accounting, are unchanged
    options = {"rounds": 2, "dp_noise": 1.0}
    ring, levels = _run(**options), _run(**options, compress="int8")
    for exact, rounded in zip(ring.records, levels.records, strict=True):
        assert rounded.participants == exact.participants == 12
        assert rounded.scalars["dp_epsilon"] == exact.scalars["dp_epsilon"]
    assert all(torch.isfinite(t).all() for t in levels.final_shared.values())


def test_the_discrete_gaussian_on_levels_is_counted_on_their_coarser_grid() -> None:
    options = {
        "rounds": 2,
        "devices": 16,
        "participation": 0.5,
        "dp_noise": 1.0,
        "dp_placement": "device",
        "dp_distribution": "discrete-gaussian",
    }
    ring, levels = _run(**options), _run(**options, compress="int8")
    for fine, coarse in zip(ring.records, levels.records, strict=True):
        assert coarse.participants == fine.participants
        assert coarse.scalars["secagg_survivors"] == coarse.participants
        # the conditional rounding's bound grows on a coarse grid: less privacy, counted
        assert coarse.scalars["dp_noise_multiplier"] < fine.scalars["dp_noise_multiplier"]
        assert coarse.scalars["dp_epsilon"] > fine.scalars["dp_epsilon"]


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"compress": "topk:0.1"}, "top-k"),
        ({"compress": "int8"}, None),
        ({"compress": "int8:stochastic"}, None),
    ],
)
def test_only_top_k_is_refused_under_secure_aggregation(
    options: dict[str, Any], reason: str | None
) -> None:
    if reason is None:
        assert _run(rounds=1, **options).records[0].participants == 12
    else:
        with pytest.raises(ValueError, match=reason):
            _run(rounds=1, **options)
