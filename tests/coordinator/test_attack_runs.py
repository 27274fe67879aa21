"""Whole simulated runs with lying devices: a robust aggregator keeps what the mean loses."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.engine.metrics import summarize_evaluations
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.attacks import AttackName, AttackPlan
from device_agent.virtual_fleet import device_name

OLD_BOUNDS: dict[str, Any] = {"max_count_ratio": 0.0, "norm_bound": 10.0}
"""The guard before the count cap: a share cap of 0.5 and norms clipped to 10x the median."""


def _honest_global(
    attack: AttackName,
    fraction: float,
    task: str,
    devices: int,
    rounds: int,
    *,
    clean: bool = False,
    **options: Any,
) -> float:
    """Final global accuracy over the honest devices of a run with `fraction` liars.

    `clean`: the same run without the attack, measured over the same devices.
    """
    settings = SimulationSettings.load(
        None,
        task=task,
        devices=devices,
        workers=1,
        rounds=rounds,
        attack="none" if clean else attack,
        malicious_fraction=0.0 if clean else fraction,
        **options,
    )
    liars = AttackPlan.draw(attack, fraction, devices, 0, None).malicious
    honest = {device_name(i) for i in range(devices) if i not in liars}
    result = run_simulation(settings)
    assert {r.device_id for r in result.reports} == {device_name(i) for i in range(devices)}
    value = summarize_evaluations([r for r in result.reports if r.device_id in honest])["global"]
    assert value is not None
    return value


def _honest_accuracy(
    aggregation: str, task: str = "synthetic", devices: int = 8, rounds: int = 8
) -> float:
    """Final global accuracy over the honest devices of a run with 25% scaling liars."""
    options = {"robust_aggregation": aggregation}
    return _honest_global("scaling", 0.25, task, devices, rounds, algorithm_options=options)


def test_under_a_quarter_of_scaling_liars_robust_aggregation_keeps_the_model() -> None:
    mean = _honest_accuracy("mean")
    clipped = _honest_accuracy("centered-clipping")
    median = _honest_accuracy("median")
    # measured over the honest devices: 0.78 against 0.28 (0.14 behind the old 10x norm bound);
    # the median (0.26) is no better than the guarded mean here
    assert clipped > mean + 0.2
    assert clipped > median + 0.2


def test_one_scaling_liar_of_four_ruins_the_mean_in_three_rounds_not_centered_clipping() -> None:
    """The red team's case: one liar of 4 within the guard's per-round bounds, digits."""
    mean = _honest_accuracy("mean", "digits", devices=4, rounds=3)
    clipped = _honest_accuracy("centered-clipping", "digits", devices=4, rounds=3)
    assert mean < 0.5  # measured over the 3 honest devices: 0.42 (0.13 behind the old 10x
    # norm bound; clean, all 4: 0.77): 25% liars are past what the guard's defaults hold
    assert clipped > mean + 0.15  # measured: 0.61


def test_a_free_riders_declared_count_passes_the_coordinators_checks() -> None:
    """The attack runs through the real intake: its hello and its update are accepted."""
    settings = SimulationSettings.load(
        None,
        task="synthetic",
        devices=4,
        workers=1,
        rounds=1,
        attack="free-rider",
        malicious_fraction=0.25,
    )
    result = run_simulation(settings)
    assert result.summary.rejected_messages == 0
    assert result.records[0].participants == 4
    assert result.records[0].dropped == 0


DIGITS_SYNC: dict[str, Any] = {"task": "digits", "devices": 20, "rounds": 20}
DIGITS_ASYNC: dict[str, Any] = {
    **DIGITS_SYNC,
    "rounds": 40,
    "mode": "async",
    "buffer": 5,
    "sim_speeds": "lognormal:10",
    "fair_share": 0.0,
}
"""The robustness table's runs (benchmarks/robustness.py): 20 devices, 10% liars are 2.

Async without the fair share (the table runs with it): these tests are of the guard's bounds
alone (with the fair share the old bounds' scaling run keeps 0.24, the guarded one 0.72)."""


@pytest.mark.parametrize(
    ("attack", "run"),
    [
        # each free rider within the old share cap, together they weighed almost everything;
        # measured: 0.07 behind the old bounds, 0.80 now (clean, the same 18 devices: 0.84)
        ("free-rider", DIGITS_SYNC),
        # a 100x update clipped to 10x the median dominated a buffer of 5, at 4x it does not;
        # measured: 0.14 behind the old bounds, 0.74 now (clean, the same 18 devices: 0.78)
        ("scaling", DIGITS_ASYNC),
    ],
)
def test_ten_percent_liars_no_longer_collapse_the_global_model(
    attack: AttackName, run: dict[str, Any]
) -> None:
    clean = _honest_global(attack, 0.1, clean=True, **run)
    guarded = _honest_global(attack, 0.1, **run)
    old = _honest_global(attack, 0.1, **run, **OLD_BOUNDS)
    assert old < 0.3
    assert guarded > clean - 0.1
    assert guarded > old + 0.5
