"""A coordinator and real agent processes over real brokers: equality, failures, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from coordinator.engine.rounds import RoundRecord
from coordinator.ops.status import collect_fleet_view
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols import topics
from protocols.messages import DeviceStatus
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import free_port, wait_for_port
from tests.e2e.conftest import (
    CEILING_S,
    account_flags,
    serve_killed_after,
    serve_settings,
)
from tests.run_metrics import metrics_lines
from tests.wiretap import decoded_into

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]
RUN = {"task": "digits", "algorithm": "fedavg", "seed": 0}


def _serve_settings(url: str, tmp_path: Path, **values: object) -> ServeSettings:
    return serve_settings(url, tmp_path, **{**RUN, "rounds": 3, "round_timeout": 20.0, **values})


def _simulate(rounds: int, **values: object):
    return run_simulation(
        SimulationSettings.load(None, **RUN, devices=3, rounds=rounds, batched="off", **values)
    )


def _round_ids(run_dir: Path) -> list[int]:
    return [line["round_id"] for line in metrics_lines(run_dir)]


def test_three_agent_processes_reproduce_the_simulation(mosquitto, processes, tmp_path) -> None:
    # Prepare
    processes.fleet(mosquitto.url, 3)
    # Execute
    served = run_serve(_serve_settings(mosquitto.url, tmp_path))
    simulated = _simulate(3)
    view = collect_fleet_view(BrokerSettings(url=mosquitto.url), "default", listen_s=1.0)
    # Assert
    assert [r.train_loss for r in served.records] == [r.train_loss for r in simulated.records]
    assert served.summary.metrics == simulated.summary.metrics
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
    assert _round_ids(tmp_path / "run") == [1, 2, 3]
    assert view.coordinator is not None
    assert view.coordinator.state == "finished"
    assert [(row["device"], row["round"]) for row in view.rows()] == [
        ("dev-0000", 3),
        ("dev-0001", 3),
        ("dev-0002", 3),
    ]


def test_an_agent_killed_mid_round_is_excluded_then_rejoins(mosquitto, processes, tmp_path) -> None:
    # Prepare: a listener for device statuses, three agents
    statuses: list[DeviceStatus] = []
    listener = MqttTransport(BrokerSettings(url=mosquitto.url), "test-listener", clean_start=True)
    listener.subscribe(
        topics.device_subscription("default", "status"),
        decoded_into(DeviceStatus, statuses),
    )
    processes.fleet(mosquitto.url, 3)

    def on_round(record: RoundRecord) -> None:
        victim = processes.running["dev-0001"]
        if record.round_id == 1:  # freeze it before round 2 is announced, kill it mid-round
            os.kill(victim.pid, signal.SIGSTOP)
            threading.Timer(1.0, victim.kill).start()
        elif record.round_id == 2:
            victim.wait(timeout=CEILING_S)
            processes.agent(mosquitto.url, 1, shards=3)

    # Execute: round 2 closes when the killed agent's last-will arrives, not at its deadline
    run_serve(_serve_settings(mosquitto.url, tmp_path, round_timeout=60.0), on_round=on_round)
    listener.close()
    # Assert: round 2 closed on quorum without the killed agent, round 3 had it back
    lines = metrics_lines(tmp_path / "run")
    assert [(x["round_id"], x["selected"], x["participants"]) for x in lines] == [
        (1, 3, 3),
        (2, 3, 2),
        (3, 3, 3),
    ]
    lost = [s for s in statuses if s.device_id == "dev-0001" and s.state == "offline"]
    assert any(s.detail == "connection lost" for s in lost)  # the last-will


def test_a_killed_coordinator_resumes_without_repeating_or_losing_rounds(
    mosquitto, processes, tmp_path
) -> None:
    # Prepare
    processes.fleet(mosquitto.url, 3)
    flags = [
        "--broker", mosquitto.url, "--task", "digits", "--algorithm", "fedavg", "--rounds", "6",
        "--participation", "0.6", "--min-devices", "3", "--round-timeout", "20",
    ]  # fmt: skip
    # Execute: kill it once round 2 is checkpointed, then resume in-process
    killed_at = serve_killed_after(processes, flags, tmp_path, 2)
    resumed = run_serve(
        _serve_settings(mosquitto.url, tmp_path, rounds=6, participation=0.6, resume=True)
    )
    simulated = _simulate(6, participation=0.6)
    # Assert
    assert 2 <= killed_at < 6, processes.log("coordinator")
    assert _round_ids(tmp_path / "run") == [1, 2, 3, 4, 5, 6]
    assert resumed.records[0].round_id == killed_at + 1
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(resumed.final_shared[name], tensor), name
    assert resumed.summary.metrics == simulated.summary.metrics


def test_serve_without_broker_starts_an_embedded_one(processes, tmp_path) -> None:
    # Prepare
    port = free_port()
    coordinator = processes.start(
        "coordinator",
        [
            sys.executable,
            "-m",
            "coordinator.cli.app",
            "serve",
            "--port",
            str(port),
            "--rounds",
            "2",
            "--min-devices",
            "1",
            "--round-timeout",
            "30",
            "--out",
            str(tmp_path / "run"),
            "--checkpoint-dir",
            str(tmp_path / "checkpoint"),
        ],
    )
    assert wait_for_port(port, timeout_s=CEILING_S), processes.log("coordinator")
    # Execute
    account = account_flags(tmp_path / "run" / "broker" / "device.env")
    processes.agent(f"mqtt://127.0.0.1:{port}", 0, shards=20, extra=account)
    try:
        code = coordinator.wait(timeout=CEILING_S * 2)
    except subprocess.TimeoutExpired:
        pytest.fail(processes.log("coordinator"))
    # Assert
    output = processes.log("coordinator")
    assert code == 0, output
    assert f"mqtt://127.0.0.1:{port}" in output
    assert _round_ids(tmp_path / "run") == [1, 2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["metrics"]["global"] > 0
