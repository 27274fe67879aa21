"""Which runs secure aggregation within the tier's groups takes, and which it refuses (once)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.stages.compatibility import problem, stage_configs

TIERED: dict[str, Any] = {"task": "sine", "tier_aggregators": "a,b", "secagg": True}


def _problem(settings: ServeSettings | SimulationSettings) -> str | None:
    return problem(settings, stage_configs(settings))


def test_served_secure_groups_run_and_a_simulation_is_refused_with_the_reason() -> None:
    served = ServeSettings.load(None, broker="mqtt://127.0.0.1:1883", **TIERED)
    simulated = SimulationSettings.load(None, **TIERED)
    refused = _problem(simulated)
    assert _problem(served) is None
    assert refused is not None
    assert refused.startswith("the aggregator tier: does not combine with secure aggregation")
    assert "in a simulation" in refused


@pytest.mark.parametrize("placement", ["device", "coordinator"])
def test_noise_placed_on_devices_is_refused_with_groups_and_central_noise_runs(
    placement: str,
) -> None:
    private = {**TIERED, "dp_noise": 1.0, "dp_placement": placement}
    found = _problem(ServeSettings.load(None, broker="mqtt://127.0.0.1:1883", **private))
    if placement == "device":
        assert found is not None
        assert found.startswith("the aggregator tier: does not combine with --dp-placement device")
    else:
        assert found is None
