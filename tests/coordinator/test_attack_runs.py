"""Whole simulated runs with lying devices: a robust aggregator keeps what the mean loses."""

from __future__ import annotations

from coordinator.metrics import summarize_evaluations
from coordinator.settings import SimulationSettings
from coordinator.simulate import run_simulation
from device_agent.attacks import AttackPlan
from device_agent.virtual_fleet import device_name


def _honest_accuracy(
    aggregation: str, task: str = "synthetic", devices: int = 8, rounds: int = 8
) -> float:
    """Final global accuracy over the honest devices of a run with 25% scaling liars."""
    settings = SimulationSettings.load(
        None,
        task=task,
        devices=devices,
        workers=1,
        rounds=rounds,
        attack="scaling",
        malicious_fraction=0.25,
        algorithm_options={"robust_aggregation": aggregation},
    )
    liars = AttackPlan.draw("scaling", 0.25, devices, 0, None).malicious
    honest = {device_name(i) for i in range(devices) if i not in liars}
    result = run_simulation(settings)
    assert {r.device_id for r in result.reports} == {device_name(i) for i in range(devices)}
    value = summarize_evaluations([r for r in result.reports if r.device_id in honest])["global"]
    assert value is not None
    return value


def test_under_a_quarter_of_scaling_liars_robust_aggregation_keeps_the_model() -> None:
    mean = _honest_accuracy("mean")
    clipped = _honest_accuracy("centered-clipping")
    median = _honest_accuracy("median")
    assert clipped > mean + 0.2  # measured over the honest devices: 0.78 against 0.14
    assert median > mean


def test_one_scaling_liar_of_four_ruins_the_mean_in_three_rounds_not_centered_clipping() -> None:
    """The red team's case: one liar of 4 within the guard's per-round bounds, digits."""
    mean = _honest_accuracy("mean", "digits", devices=4, rounds=3)
    clipped = _honest_accuracy("centered-clipping", "digits", devices=4, rounds=3)
    assert mean < 0.4  # measured over the 3 honest devices: 0.13 (clean, all 4: 0.77)
    assert clipped > mean + 0.3  # measured: 0.63


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
