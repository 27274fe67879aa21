"""`--model` end to end: a served mnist1d GRU run with agent processes given the same model."""

from __future__ import annotations

import pytest
import torch

from coordinator.run.serve import run_serve
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from tests.e2e.conftest import serve_settings

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]

RUN = {"task": "mnist1d", "model": "gru", "algorithm": "fedavg", "seed": 0, "rounds": 1}


def test_agents_given_the_model_reproduce_the_simulation(mosquitto, processes, tmp_path) -> None:
    # Prepare: three agents told the coordinator's model
    processes.fleet(mosquitto.url, 3, task="mnist1d", extra=("--model", "gru"))
    # Execute
    served = run_serve(serve_settings(mosquitto.url, tmp_path, **RUN, round_timeout=120.0))
    simulated = run_simulation(SimulationSettings.load(None, **RUN, devices=3, batched="off"))
    # Assert: the GRU's tensors were trained and averaged exactly as in the simulation
    assert "input.weight_hh_l0" in served.final_shared  # a recurrent layer's, not the CNN's
    assert [r.train_loss for r in served.records] == [r.train_loss for r in simulated.records]
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
