"""A finished run's fleet metric as a number, for tests that compare runs."""

from __future__ import annotations

from coordinator.run.summary import RunSummary


def fleet_metric(summary: RunSummary, name: str = "personalized_mean") -> float:
    """`summary.metrics[name]`; a run that evaluated nothing fails the test here, by name."""
    assert summary.metrics is not None, "the run evaluated no device"
    value = summary.metrics[name]
    assert value is not None, f"the run reported no {name}"
    return value
