"""Secure aggregation within each aggregator's group, with real agent and aggregator processes.

Six agents and two `pfl-coord aggregator` processes share one mosquitto broker: each aggregator
runs secure aggregation with its three devices (the roster and the unmasking on each device's
own topic, so the other group's devices never see them) and sends its group's unmasked sum; the
coordinator combines the two sums. The model equals the single-coordinator secure run's within
the fixed-point error.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.run.serve import run_serve
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import device_name, run_simulation
from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes, serve_settings, wait_for

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]
RUN: dict[str, Any] = {"task": "digits", "algorithm": "fedavg", "seed": 0, "secagg": True}
DEVICES = 6
GROUPS = {"a": (0, 1, 2), "b": (3, 4, 5)}


def _start_aggregators(processes: Processes, url: str) -> None:
    """Each group's aggregator on the one broker, its devices listed (logging what it does)."""
    for name, indices in GROUPS.items():
        listed = [flag for i in indices for flag in ("--devices", device_name(i))]
        command = [
            sys.executable, "-m", "coordinator.cli.app", "aggregator",
            "--broker", url, "--name", name, *listed, "--verbose",
        ]  # fmt: skip
        processes.start(f"aggregator-{name}", command, {"COLUMNS": "400"})  # one line a record
        wait_for(partial(_serving, processes, name), f"aggregator {name} serving")


def _serving(processes: Processes, name: str) -> bool:
    return "serving" in processes.log(f"aggregator-{name}")


def test_two_groups_aggregate_securely_as_the_single_coordinator_does(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path
) -> None:
    # Prepare
    _start_aggregators(processes, mosquitto.url)
    processes.fleet(mosquitto.url, DEVICES)
    # Execute
    settings = serve_settings(
        mosquitto.url, tmp_path, **RUN, rounds=2, min_devices=DEVICES, tier_aggregators="a,b"
    )
    served = run_serve(settings)
    single = run_simulation(
        SimulationSettings.load(None, **RUN, rounds=2, devices=DEVICES, batched="off")
    )
    # Assert: every device's masked update reached the model through its group's sum
    assert [r.participants for r in served.records] == [DEVICES, DEVICES]
    assert [r.scalars["tier_partials"] for r in served.records] == [2.0, 2.0]
    assert [r.scalars["secagg_survivors"] for r in single.records] == [6.0, 6.0]
    for name in GROUPS:
        log = processes.log(f"aggregator-{name}")
        assert log.count("asks 3 of its devices (secure aggregation within the group)") == 2
        assert log.count("partial of 3 devices (0 declined)") == 2
    # the same fixed point (one cohort, one scale) summed in two groups, not in one
    for name, tensor in single.final_shared.items():
        assert torch.allclose(served.final_shared[name], tensor, rtol=0, atol=1e-6), name
    assert served.summary.metrics is not None
    assert single.summary.metrics is not None
    for key, value in single.summary.metrics.items():
        assert served.summary.metrics[key] == pytest.approx(value, abs=1e-4), key
