"""A simulation with the aggregator tier trains the model the single coordinator trains."""

from __future__ import annotations

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation

RUN = {"task": "digits", "devices": 12, "rounds": 3, "seed": 0, "workers": 1}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedalt"])
def test_three_aggregators_give_the_single_coordinators_model(algorithm: str) -> None:
    single = run_simulation(SimulationSettings.load(None, **RUN, algorithm=algorithm))
    tier = run_simulation(
        SimulationSettings.load(None, **RUN, algorithm=algorithm, tier_aggregators="a,b,c")
    )
    assert [r.participants for r in tier.records] == [12, 12, 12]
    assert all(r.scalars["tier_partials"] == 3.0 for r in tier.records)
    for name, tensor in single.final_shared.items():
        assert torch.equal(tier.final_shared[name], tensor), name


def test_dp_is_added_once_at_the_top_and_accounted_as_without_the_tier() -> None:
    private = {**RUN, "algorithm": "fedavg", "dp_noise": 1.0, "dp_clip": 0.5}
    single = run_simulation(SimulationSettings.load(None, **private))
    tier = run_simulation(SimulationSettings.load(None, **private, tier_aggregators="a,b"))
    epsilons = [r.scalars["dp_epsilon"] for r in tier.records]
    assert epsilons == [r.scalars["dp_epsilon"] for r in single.records]
    for name, tensor in single.final_shared.items():  # the same noise, on the same sum
        assert torch.allclose(tier.final_shared[name], tensor, atol=1e-5), name
