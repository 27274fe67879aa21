"""Whole simulated runs with lying devices: a robust aggregator keeps what the mean loses."""

from __future__ import annotations

from coordinator.metrics import summarize_evaluations
from coordinator.settings import SimulationSettings
from coordinator.simulate import run_simulation
from device_agent.attacks import AttackPlan
from device_agent.virtual_fleet import device_name

DEVICES = 8


def _honest_accuracy(aggregation: str, attack: str = "scaling") -> float:
    """Final global accuracy over the honest devices of a synthetic run with 25% liars."""
    settings = SimulationSettings.load(
        None,
        task="synthetic",
        devices=DEVICES,
        workers=1,
        rounds=8,
        attack=attack,
        malicious_fraction=0.25,
        algorithm_options={"robust_aggregation": aggregation},
    )
    liars = AttackPlan.draw(attack, 0.25, DEVICES, 0, None).malicious  # type: ignore[arg-type]
    honest = {device_name(i) for i in range(DEVICES) if i not in liars}
    result = run_simulation(settings)
    assert {r.device_id for r in result.reports} == {device_name(i) for i in range(DEVICES)}
    value = summarize_evaluations([r for r in result.reports if r.device_id in honest])["global"]
    assert value is not None
    return value


def test_under_a_quarter_of_scaling_liars_robust_aggregation_keeps_the_model() -> None:
    mean = _honest_accuracy("mean")
    clipped = _honest_accuracy("centered-clipping")
    median = _honest_accuracy("median")
    assert clipped > mean + 0.2  # measured: 0.80 against 0.26
    assert median > mean


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
