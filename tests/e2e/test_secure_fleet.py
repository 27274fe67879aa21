"""Secure aggregation with real agent processes over mosquitto: the same model as simulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.stages.accountant import DpRound, epsilons_of
from coordinator.stages.discrete_accountant import RingRound
from protocols import secure_aggregation as sa
from protocols.messages import SecureRound
from protocols.secure_levels import LEVELS
from tests.e2e.conftest import serve_settings

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]
RUN = {"task": "digits", "algorithm": "fedalt", "seed": 0, "secagg": True, "rounds": 2}


def _serve_three(mosquitto, processes, tmp_path: Path, run: dict[str, Any]) -> ServeResult:
    """`run` served to three pfl-agent processes over mosquitto."""
    processes.fleet(mosquitto.url, 3)
    return run_serve(serve_settings(mosquitto.url, tmp_path, **run))


def test_three_agent_processes_aggregate_securely_as_the_simulation_does(
    mosquitto, processes, tmp_path: Path
) -> None:
    # Execute
    served = _serve_three(mosquitto, processes, tmp_path, RUN)
    simulated = run_simulation(SimulationSettings.load(None, **RUN, devices=3, batched="off"))
    plain = run_simulation(
        SimulationSettings.load(None, **{**RUN, "secagg": False}, devices=3, batched="off")
    )
    # Assert: masks cancel exactly, so serving and simulating agree bit for bit
    assert [r.scalars["secagg_survivors"] for r in served.records] == [3.0, 3.0]
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
        assert torch.allclose(plain.final_shared[name], tensor, atol=1e-5), name
    assert served.summary.metrics == simulated.summary.metrics


def test_three_agent_processes_add_the_distributed_discrete_gaussian_in_the_ring(
    mosquitto, processes, tmp_path: Path
) -> None:
    # Prepare
    private = {
        **RUN,
        "dp_noise": 1.0,
        "dp_placement": "device",
        "dp_distribution": "discrete-gaussian",
    }
    # Execute
    served = _serve_three(mosquitto, processes, tmp_path, private)
    noiseless = run_simulation(
        SimulationSettings.load(None, **{**private, "dp_noise": 0.0}, devices=3, batched="off")
    )
    # Assert: every round summed the three devices' integer shares and was counted as such
    assert [r.scalars["secagg_survivors"] for r in served.records] == [3.0, 3.0]
    share = 1.0 / 3**0.5  # z C / sqrt(m): each device's part of the noise
    grid = sa.delta_scale(
        SecureRound(
            threshold=0.6, cohort=3, min_survivors=3, clip_norm=1.0, value_bound=1 + 8 * share
        )
    )
    dimension = sum(t.numel() for t in served.final_shared.values())
    ring = RingRound.of(1.0, grid, share, 3, dimension)
    spent = DpRound(1 / ring.epsilon(), 3, 3.0, ring)
    expected = [epsilons_of([spent] * n, "poisson", 1e-5).rdp for n in (1, 2)]
    assert [r.scalars["dp_epsilon"] for r in served.records] == pytest.approx(expected)
    assert all("dp_epsilon_pld" not in r.scalars for r in served.records)
    moved = [
        float((served.final_shared[n] - t).double().norm())
        for n, t in noiseless.final_shared.items()
    ]
    assert all(torch.isfinite(t).all() for t in served.final_shared.values())
    assert sum(moved) > 0.1  # the noise is in the model (without it, rounding moves it 1e-6)


def test_three_agent_processes_sum_int8_levels_within_one_step_of_the_exact_sum(
    mosquitto, processes, tmp_path: Path
) -> None:
    # Prepare: one round, uniform weights, so each entry's step is the clip / 127
    run = {
        **RUN,
        "algorithm": "fedavg",
        "rounds": 1,
        "secagg_clip": 1.0,
        "algorithm_options": {"aggregation_weights": "uniform"},
    }
    # Execute
    served = _serve_three(mosquitto, processes, tmp_path, {**run, "compress": "int8"})
    exact = run_simulation(SimulationSettings.load(None, **run, devices=3, batched="off"))
    # Assert: the agents' own (unseeded) rounding moves the mean by under one level
    assert [r.scalars["secagg_survivors"] for r in served.records] == [3.0]
    differences = [
        float((served.final_shared[name] - tensor).abs().max())
        for name, tensor in exact.final_shared.items()
    ]
    assert 0 < max(differences) <= (1 + 1e-6) / LEVELS  # rounded, as served bit for bit else
