"""Secure aggregation with real agent processes over mosquitto: the same model as simulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.serve import run_serve
from coordinator.settings import ServeSettings, SimulationSettings
from coordinator.simulate import run_simulation

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(120)]
RUN = {"task": "digits", "algorithm": "fedalt", "seed": 0, "secagg": True, "rounds": 2}


def test_three_agent_processes_aggregate_securely_as_the_simulation_does(
    mosquitto, processes, tmp_path: Path
) -> None:
    # Prepare
    for index in range(3):
        processes.agent(mosquitto.url, index, shards=3)
    settings = ServeSettings.load(
        None,
        **RUN,
        broker=mosquitto.url,
        min_devices=3,
        round_timeout=30.0,
        join_timeout=60.0,
        out=tmp_path / "run",
        checkpoint_dir=tmp_path / "checkpoint",
    )
    # Execute
    served = run_serve(settings)
    simulated = run_simulation(SimulationSettings.load(None, **RUN, devices=3))
    plain = run_simulation(SimulationSettings.load(None, **{**RUN, "secagg": False}, devices=3))
    # Assert: masks cancel exactly, so serving and simulating agree bit for bit
    assert [r.scalars["secagg_survivors"] for r in served.records] == [3.0, 3.0]
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
        assert torch.allclose(plain.final_shared[name], tensor, atol=1e-5), name
    assert served.summary.metrics == simulated.summary.metrics
