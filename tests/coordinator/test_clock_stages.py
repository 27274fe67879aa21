"""Synchronous rounds on the simulated clock with differential privacy and secure aggregation.

The clock decides who finishes by the deadline; the engine's one round then runs the stages
and the uplink path as it does without a clock.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation

pytestmark = pytest.mark.slow
RUN: dict[str, Any] = {"task": "digits", "devices": 8, "rounds": 2, "seed": 3, "workers": 1}
CLOCK: dict[str, Any] = {"sim_speeds": "lognormal:10", "sim_deadline": 3.0}


def _run(*, clock: bool = True, **values: Any) -> SimulationResult:
    return run_simulation(
        SimulationSettings.load(None, **RUN, **(CLOCK if clock else {}), **values)
    )


def test_dp_on_the_clock_accounts_the_planned_cohort_and_noises_only_the_updates_in_time() -> None:
    # Prepare: the same run without the clock accounts the same cohorts
    dp: dict[str, Any] = {"dp_noise": 1.0, "dp_clip": 0.5, "dp_sampling": "fixed"}
    # Execute
    clocked = _run(**dp)
    unclocked = _run(clock=False, **dp)
    # Assert: late devices miss the round; the accountant counts every round as planned
    assert unclocked.records[0].sim_seconds is None
    for record, plain in zip(clocked.records, unclocked.records, strict=True):
        assert record.scalars["late"] > 0
        assert record.participants + record.scalars["late"] == record.selected == plain.selected
        assert record.scalars["dp_epsilon"] == plain.scalars["dp_epsilon"] > 0
        assert "update_norm_median" not in record.scalars
    assert [r.sim_seconds for r in clocked.records] == pytest.approx([3.0, 6.0])
    assert clocked.summary.privacy is not None
    assert clocked.summary.privacy["rounds_released"] == 2
    again = _run(**dp)  # the seed alone decides the noise, the cohort and the clock
    assert all(torch.equal(again.final_shared[k], v) for k, v in clocked.final_shared.items())


def test_secure_aggregation_on_the_clock_sums_the_devices_that_plain_rounds_average() -> None:
    # Execute
    secure = _run(secagg=True)
    plain = _run()
    # Assert: the same devices in time, their sum (in the ring's fixed point) the plain mean
    for record, reference in zip(secure.records, plain.records, strict=True):
        assert record.scalars["late"] == reference.scalars["late"] > 0
        assert record.scalars["secagg_survivors"] == record.participants
        assert record.participants == reference.participants
        assert record.sim_seconds == reference.sim_seconds
    for name, tensor in plain.final_shared.items():
        assert torch.allclose(secure.final_shared[name], tensor, atol=1e-4), name


def test_device_noised_dp_over_secure_aggregation_runs_on_the_clock() -> None:
    # Execute: each device adds its share of the noise; only the sum in time is unmasked
    dp: dict[str, Any] = {"dp_noise": 1.0, "dp_placement": "device", "dp_sampling": "fixed"}
    result = _run(secagg=True, **dp)
    # Assert
    for record in result.records:
        assert record.scalars["late"] > 0
        assert record.scalars["secagg_survivors"] == record.participants
        assert record.participants + record.scalars["late"] == record.selected
        assert record.scalars["dp_epsilon"] > 0
        assert math.isnan(record.train_loss)
    assert all(torch.isfinite(v).all() for v in result.final_shared.values())
