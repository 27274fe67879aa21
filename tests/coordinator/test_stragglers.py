"""Stragglers: selected devices still connected at the deadline, named in the fleet status."""

from __future__ import annotations

import json
import logging
import time

import pytest
from typer.testing import CliRunner

from coordinator.cli.app import app
from coordinator.engine.rounds import EngineSettings
from coordinator.ops.status import FleetView
from coordinator.ops.status_pages import PagedFleet, retained_pages
from coordinator.run.settings import SimulationSettings
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import CoordinatorStatus, FleetDevice, FleetStatus, RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.hub_fleet import TASK, hub_agents, hub_engine, hub_impostor

DEADLINE_S = 1.0
SLOW = "dev-slow"


def test_a_device_that_lets_the_deadline_pass_is_a_straggler_of_that_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Arrange: three agents and one connected device that never answers a round
    broker = InProcessBroker()
    settings = SimulationSettings.load(None, task=TASK, algorithm="fedavg", devices=3)
    engine = EngineSettings(task=TASK, rounds=3, quorum=0.5, round_timeout_s=DEADLINE_S, seed=1)
    coordinator = hub_engine(broker, settings, engine)
    coordinator.start()

    def never_answer(device: Transport, announcement: RoundAnnouncement) -> None:
        del device, announcement  # a device on a link too slow for the deadline

    hub_impostor(broker, SLOW, never_answer)
    hub_agents(broker, ["dev-0", "dev-1", "dev-2"])
    assert coordinator.wait_for_devices(4, 5.0)

    # Act: two rounds the slow device lets pass
    with caplog.at_level(logging.WARNING, logger="coordinator.stages.uplink"):
        first = coordinator.run_round()
        second = coordinator.run_round()

    # Assert: the rounds closed without it, and the fleet status names it a straggler of round 2
    assert (first.participants, second.participants) == (3, 3)
    status = coordinator.last_fleet_status
    assert status is not None
    devices = {d.device_id: d for d in status.devices}
    assert (devices[SLOW].missed_deadlines, devices[SLOW].missed_round) == (2, 2)
    assert all(devices[d].missed_deadlines == 0 for d in ("dev-0", "dev-1", "dev-2"))
    view = FleetView("default", paged=PagedFleet.of(status))
    assert view.stragglers() == [SLOW]
    assert view.as_json()["stragglers"] == [SLOW]
    assert {row["device"]: row["missed_deadlines"] for row in view.rows()}[SLOW] == 2
    assert "round 1: 1 straggler(s) missed the 1 s deadline: dev-slow" in caplog.text


def test_a_round_everyone_answered_has_no_straggler() -> None:
    # Arrange
    broker = InProcessBroker()
    settings = SimulationSettings.load(None, task=TASK, algorithm="fedavg", devices=2)
    engine = EngineSettings(task=TASK, rounds=1, quorum=1.0, round_timeout_s=30.0, seed=1)
    coordinator = hub_engine(broker, settings, engine)
    coordinator.start()
    hub_agents(broker, ["dev-0", "dev-1"])
    assert coordinator.wait_for_devices(2, 5.0)

    # Act
    coordinator.run_round()

    # Assert
    status = coordinator.last_fleet_status
    assert status is not None
    assert all(d.missed_deadlines == 0 and d.missed_round is None for d in status.devices)
    assert FleetView("default", paged=PagedFleet.of(status)).stragglers() == []


@pytest.mark.mosquitto
def test_pfl_coord_status_names_the_last_rounds_stragglers(mosquitto: Mosquitto) -> None:
    # Arrange: round 2's fleet status: one straggler of round 2, one of round 1 only
    devices = (
        FleetDevice(device_id="dev-0000", online=True, last_seen=time.time()),
        FleetDevice(
            device_id="dev-0001", online=True, last_seen=time.time(), missed_deadlines=2,
            missed_round=2,
        ),
        FleetDevice(
            device_id="dev-0002", online=True, last_seen=time.time(), missed_deadlines=1,
            missed_round=1,
        ),
    )  # fmt: skip
    running = CoordinatorStatus(state="running", fleet="default", round_id=2, rounds=5)
    with MqttTransport(BrokerSettings(url=mosquitto.url), "straggler-publisher") as publisher:
        publisher.publish(topics.coordinator_status("default"), encode_frame(running), retain=True)
        status = FleetStatus(fleet="default", round_id=2, devices=devices)
        for topic, frame in retained_pages(status):
            publisher.publish(topic, frame, retain=True)
        assert publisher.flush(5)
    runner = CliRunner()

    # Act
    table = runner.invoke(app, ["status", "--broker", mosquitto.url, "--listen", "1"])
    as_json = runner.invoke(app, ["status", "--broker", mosquitto.url, "--listen", "1", "--json"])

    # Assert
    assert table.exit_code == 0, table.output
    assert "round 2: 1 straggler(s) missed the deadline while connected: dev-0001" in table.output
    assert as_json.exit_code == 0, as_json.output
    view = json.loads(as_json.output)
    assert view["stragglers"] == ["dev-0001"]
    assert [row["missed_deadlines"] for row in view["devices"]] == [0, 2, 1]
