"""A simulation spread over processes: pools of virtual devices against mosquitto and `serve`."""

from __future__ import annotations

import sys

import pytest
import torch

from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from tests.e2e.conftest import Processes

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(180)]

RUN = {"task": "synthetic", "algorithm": "fedalt", "rounds": 3, "participation": 0.5, "seed": 4}
FLEET = 12


def _pool(processes: Processes, url: str, name: str, devices: str) -> None:
    processes.start(
        name,
        [
            sys.executable, "-m", "device_agent.cli", "pool", "--broker", url,
            "--devices", devices, "--num-shards", str(FLEET), "--task", "synthetic",
            "--seed", "4",
        ],
    )  # fmt: skip


def test_two_pools_and_serve_over_mosquitto_equal_the_in_process_run(
    mosquitto, processes: Processes, tmp_path
) -> None:
    # Prepare: two processes, each a real MQTT client per device, 7 + 5 of the 12
    _pool(processes, mosquitto.url, "pool-a", "0-6")
    _pool(processes, mosquitto.url, "pool-b", "7-11")
    settings = ServeSettings.load(
        None,
        **RUN,
        broker=mosquitto.url,
        min_devices=FLEET,
        join_timeout=90.0,
        round_timeout=60.0,
        quorum=1.0,
        checkpoint_dir=tmp_path / "checkpoint",
        out=tmp_path / "serve",
    )
    # Execute
    served = run_serve(settings)
    simulated = run_simulation(
        SimulationSettings.load(None, **RUN, devices=FLEET, workers=1, batched="off")
    )
    # Assert: the same devices worked each round, and the model and metrics are the same bits
    assert [r.participants for r in served.records] == [6, 6, 6]
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
    assert served.summary.metrics == simulated.summary.metrics
    assert [r.train_loss for r in served.records] == [r.train_loss for r in simulated.records]
    assert all(process.poll() is None for process in processes.running.values())
