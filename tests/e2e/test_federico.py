"""FedeRiCo with real agent processes over mosquitto.

The relay reproduces the simulation, a killed coordinator resumes from its checkpoint of every
device's model, and the mixtures export over MQTT and offline from a state directory, bit for
bit the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from export import read_metadata
from protocols.messages import ExportReport
from tests.e2e.conftest import (
    export_offline,
    export_over_mqtt,
    serve_killed_after,
    serve_settings,
)

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(120)]
RUN = {"task": "sine", "algorithm": "federico", "seed": 0, "lr": 0.03}


def _serve_settings(url: str, tmp_path: Path, **values: object) -> ServeSettings:
    return serve_settings(url, tmp_path, **{**RUN, "rounds": 4, **values})


def _simulate(rounds: int):
    return run_simulation(
        SimulationSettings.load(None, **RUN, devices=3, rounds=rounds, batched="off")
    )


def test_agent_processes_reproduce_the_simulation_and_export_their_mixtures(
    mosquitto, processes, tmp_path
) -> None:
    # Prepare
    processes.fleet(mosquitto.url, 3, task="sine")
    # Execute: serve 4 rounds, then `pfl-coord export` as a process
    served = run_serve(_serve_settings(mosquitto.url, tmp_path))
    simulated = _simulate(4)
    out_dir = tmp_path / "exports"
    exported = export_over_mqtt(mosquitto.url, out_dir, tmp_path)
    # Assert: the same losses, metrics and fleet scalars as the in-process relay
    assert [r.train_loss for r in served.records] == [r.train_loss for r in simulated.records]
    assert [r.scalars for r in served.records] == [r.scalars for r in simulated.records]
    assert served.summary.metrics == simulated.summary.metrics
    # Assert: every device wrote a verified mixture
    assert exported.returncode == 0, exported.stdout + exported.stderr
    rows = {row["device"]: row for row in json.loads(exported.stdout)["devices"]}
    assert sorted(rows) == ["dev-0000", "dev-0001", "dev-0002"]
    for device_id, row in rows.items():
        assert row["ok"] is True, row
        assert read_metadata(out_dir / f"{device_id}.onnx")["pfl.algorithm"] == "federico"
    # Execute: the agents stop; `pfl-agent export` works offline from dev-0001's state dir
    processes.stop_all()
    offline_path = tmp_path / "offline" / "model.onnx"
    offline = export_offline(tmp_path, "dev-0001", offline_path, task="sine", shard=1, shards=3)
    # Assert: the very file the running agent exported
    assert offline.returncode == 0, offline.stdout + offline.stderr
    report = ExportReport.model_validate_json(offline.stdout)
    assert report.ok, report.error
    assert report.sha256 == rows["dev-0001"]["sha256"]


def test_a_killed_coordinator_resumes_every_device_model(mosquitto, processes, tmp_path) -> None:
    # Prepare
    processes.fleet(mosquitto.url, 3, task="sine")
    flags = [
        "--broker", mosquitto.url, "--task", "sine", "--algorithm", "federico", "--lr", "0.03",
        "--rounds", "6", "--min-devices", "3", "--round-timeout", "30",
    ]  # fmt: skip
    # Execute: kill it once round 2 is checkpointed, then resume in-process
    killed_at = serve_killed_after(processes, flags, tmp_path, 2)
    resumed = run_serve(_serve_settings(mosquitto.url, tmp_path, rounds=6, resume=True))
    simulated = _simulate(6)
    # Assert: the rounds after the kill are exactly the uninterrupted run's
    assert 2 <= killed_at < 6, processes.log("coordinator")
    assert resumed.records[0].round_id == killed_at + 1
    tail = simulated.records[killed_at:]
    assert [r.train_loss for r in resumed.records] == [r.train_loss for r in tail]
    assert resumed.summary.metrics == simulated.summary.metrics
