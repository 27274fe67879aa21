"""`pfl-coord status` says why a coordinator waits or stopped, and whom it misses."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest
from typer.testing import CliRunner

from coordinator.cli.app import app
from coordinator.ops.status_pages import retained_pages
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import CoordinatorStatus, FleetDevice, FleetStatus, RunEvent
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto

pytestmark = pytest.mark.mosquitto


def test_status_names_the_missing_devices_and_the_deadline(mosquitto: Mosquitto) -> None:
    # Prepare: a coordinator waiting in round 4 for two devices, as it retains its status
    deadline = time.time() + 90
    waiting = CoordinatorStatus(
        state="waiting",
        fleet="default",
        round_id=3,
        rounds=9,
        missing=("dev-0002", "dev-0007"),
        missing_count=3,
        deadline=deadline,
        events=(RunEvent(at=time.time(), level="warn", text="dev-0002 left"),),
    )
    row = FleetDevice(
        device_id="dev-0001", online=True, last_seen=time.time(), bytes_up=5, round_seconds=2.5
    )
    fleet = FleetStatus(fleet="default", round_id=3, devices=(row,))
    with MqttTransport(BrokerSettings(url=mosquitto.url), "pfl-coord-test", clean_start=True) as t:
        t.publish(topics.coordinator_status("default"), encode_frame(waiting), retain=True)
        for topic, frame in retained_pages(fleet):
            t.publish(topic, frame, retain=True)
    runner = CliRunner()

    # Execute
    table = runner.invoke(app, ["status", "--broker", mosquitto.url, "--listen", "1"])
    as_json = runner.invoke(app, ["status", "--broker", mosquitto.url, "--listen", "1", "--json"])

    # Assert
    assert table.exit_code == 0, table.output
    until = datetime.fromtimestamp(deadline).strftime("%H:%M:%S")
    assert f"waiting: missing: dev-0002, dev-0007 and 1 more; until {until}" in table.output
    assert "coordinator waiting, round 3/9" in table.output
    view = json.loads(as_json.output)
    assert view["coordinator"]["missing"] == ["dev-0002", "dev-0007"]
    assert view["coordinator"]["events"][0]["text"] == "dev-0002 left"
    assert view["devices"][0]["bytes_up"] == 5
    assert view["devices"][0]["round_seconds"] == 2.5
