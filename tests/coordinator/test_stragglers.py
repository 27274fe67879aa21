"""Stragglers: selected devices still connected at the deadline, named in the fleet status."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine.rounds import EngineSettings
from coordinator.ops.status import FleetView
from coordinator.run.settings import SimulationSettings
from protocols.messages import RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker
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
    view = FleetView("default", fleet=status)
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
    assert FleetView("default", fleet=status).stragglers() == []
