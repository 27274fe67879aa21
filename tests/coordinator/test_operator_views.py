"""Operator views take from each topic only what it may carry, with real times and bounded size.

A device may publish only under its own subtree; everything it publishes there reaches
`pfl-coord status` and the dashboard, which must not let it speak for the coordinator or for
another device, nor blank the page or crash the command with a time of Infinity.
"""

from __future__ import annotations

import threading
import time

import pytest
from typer.testing import CliRunner

from coordinator.cli.app import app
from coordinator.dashboard.board import MAX_BOARD_ROWS, Board
from coordinator.dashboard.feeds import ViewTap
from coordinator.ops.status import FleetView
from coordinator.ops.status_pages import retained_pages
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import (
    CoordinatorStatus,
    DeviceResult,
    DeviceStatus,
    FleetDevice,
    FleetStatus,
    RunHistory,
)
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.forged_views import forged_views, strict_json

FLEET = "default"
EVIL = "dev-evil"
RUN_ID = "cd" * 16


def _forged_on_own_topic() -> list[tuple[str, bytes]]:
    return forged_views(FLEET, EVIL, [f"dev-{i:04d}" for i in range(3)], RUN_ID)


def _honest() -> list[tuple[str, bytes]]:
    devices = tuple(
        FleetDevice(device_id=f"dev-{i:04d}", online=True, last_seen=time.time()) for i in range(3)
    )
    return [
        (
            topics.coordinator_status(FLEET),
            encode_frame(CoordinatorStatus(state="running", fleet=FLEET, round_id=2, rounds=5)),
        ),
        *retained_pages(FleetStatus(fleet=FLEET, round_id=2, devices=devices)),
        (
            topics.device(FLEET, EVIL, "status"),
            encode_frame(DeviceStatus(device_id=EVIL, state="training", round_id=2)),
        ),
    ]


def test_a_device_topic_carries_only_that_devices_own_status() -> None:
    # Prepare: the honest picture, then everything one device forges on its own topic
    view = FleetView(FLEET)
    for topic, payload in _honest():
        assert view.offer(topic, payload)
    forged = _forged_on_own_topic()
    # Execute
    taken = [view.offer(topic, payload) for topic, payload in forged]
    # Assert: nothing forged got in, each refusal counted; the honest view stands
    assert taken == [False] * len(forged)
    assert view.refused == len(forged)
    assert view.coordinator is not None
    assert (view.coordinator.state, view.coordinator.round_id, view.coordinator.rounds) == (
        "running",
        2,
        5,
    )
    assert view.history is None
    rows = {row["device"]: row for row in view.rows()}
    assert sorted(rows) == ["dev-0000", "dev-0001", "dev-0002", EVIL]
    assert all(rows[f"dev-{i:04d}"]["online"] for i in range(3))
    assert not any(row["quarantined"] for row in rows.values())
    assert rows[EVIL]["state"] == "training"
    assert all(0 < row["last_seen"] <= time.time() for row in rows.values())


def test_coordinator_kinds_count_only_on_the_coordinators_topics_of_this_fleet() -> None:
    view = FleetView(FLEET)
    other = CoordinatorStatus(state="running", fleet="other", round_id=1, rounds=2)
    assert not view.offer(topics.coordinator_status(FLEET), encode_frame(other))
    status = CoordinatorStatus(state="running", fleet=FLEET, round_id=1, rounds=2)
    assert not view.offer(topics.fleet_status(FLEET), encode_frame(status))  # the wrong one
    assert not view.offer(topics.coordinator_status(FLEET), b"not a frame")
    assert view.refused == 3
    assert view.offer(topics.coordinator_status(FLEET), encode_frame(status))
    # topics that are not view topics are passed over, not counted
    assert not view.offer(topics.round_announcement(FLEET), encode_frame(status))
    assert not view.offer(topics.device(FLEET, EVIL, "update"), b"")
    assert view.refused == 3


def test_the_board_snapshot_is_strict_json_whatever_a_device_sends() -> None:
    board = Board("test", FLEET)
    for topic, payload in [*_honest(), *_forged_on_own_topic()]:
        board.offer(topic, payload)
    snapshot = strict_json(board.snapshot_json())
    assert snapshot["coordinator"]["rounds"] == 5
    assert snapshot["refused"] == len(_forged_on_own_topic())
    assert snapshot["devices"] == []  # no forged evaluation results
    assert "ghost-1" not in {row["device"] for row in snapshot["fleet"]}


def test_a_huge_fleet_status_is_shown_bounded_and_says_how_many_are_left_out() -> None:
    # Prepare: the coordinator's own fleet status of 20,000 devices, and as many results
    count = 20_000
    devices = tuple(
        FleetDevice(device_id=f"dev-{i:05d}", online=True, last_seen=1.0) for i in range(count)
    )
    results = tuple(
        DeviceResult(
            device_id=d.device_id,
            round_id=1,
            metric_name="accuracy",
            personalized=0.5,
            num_train_samples=1,
        )
        for d in devices
    )
    board = Board("test", FLEET)
    for topic, frame in retained_pages(FleetStatus(fleet=FLEET, round_id=1, devices=devices)):
        board.offer(topic, frame)
    board.offer(
        topics.run_history(FLEET),
        encode_frame(RunHistory(fleet=FLEET, run_id=RUN_ID, devices=results)),
    )
    # Execute
    text = board.snapshot_json()
    snapshot = strict_json(text)
    # Assert
    assert len(snapshot["fleet"]) == MAX_BOARD_ROWS
    assert snapshot["fleet_left_out"] == count - MAX_BOARD_ROWS
    assert len(snapshot["devices"]) == MAX_BOARD_ROWS
    assert snapshot["devices_left_out"] == count - MAX_BOARD_ROWS
    assert len(text) < 600 * MAX_BOARD_ROWS


def _publish_retained(broker: BrokerSettings, frames: list[tuple[str, bytes]]) -> None:
    with MqttTransport(broker, "forger", clean_start=True) as forger:
        for topic, payload in frames:
            forger.publish(topic, payload, retain=True)


@pytest.mark.mosquitto
def test_pfl_coord_status_shows_the_honest_fleet_despite_forged_retained_messages(
    mosquitto: Mosquitto,
) -> None:
    # Prepare: honest retained statuses, then the forged ones retained on the device's topic
    # (the last one kept by the broker is the Infinity, NaN or future time status)
    broker = BrokerSettings(url=mosquitto.url)
    _publish_retained(broker, _honest())
    ghost = topics.device(FLEET, "ghost-3", "status")
    _publish_retained(
        broker,
        [
            *_forged_on_own_topic()[:-2],
            (ghost, encode_frame(CoordinatorStatus(state="running", fleet=FLEET, rounds=999))),
        ],
    )
    runner = CliRunner()
    # Execute
    table = runner.invoke(app, ["status", "--broker", mosquitto.url, "--listen", "1"])
    as_json = runner.invoke(app, ["status", "--broker", mosquitto.url, "--listen", "1", "--json"])
    # Assert: both exit 0 and show the honest fleet; the refusals are said
    assert table.exit_code == 0, table.output
    assert "round 2/5" in table.output
    assert "999" not in table.output
    assert "ghost" not in table.output
    assert "ignored 2 message(s)" in table.output  # the Infinity status and the ghost topic's
    assert as_json.exit_code == 0, as_json.output
    view = strict_json(as_json.output)
    assert view["coordinator"]["rounds"] == 5
    assert sorted(row["device"] for row in view["devices"]) == [
        "dev-0000",
        "dev-0001",
        "dev-0002",
    ]
    assert view["refused"] == 2


def test_the_engine_feeds_the_board_through_its_own_transport_and_never_fails_for_it() -> None:
    # Prepare: an engine-side transport tapped for a board, and a device on the same broker
    broker = InProcessBroker()
    board = Board("serve", FLEET)
    taken: list[str] = []
    honest = _honest()  # the engine's statuses (summary and rows), then the device's
    everything = threading.Event()

    def offer(topic: str, payload: bytes) -> None:
        taken.append(topic)
        if len(taken) == len(honest) + 1:  # with the history
            everything.set()
        if topic == topics.run_history(FLEET):
            msg = "a board that fails"
            raise RuntimeError(msg)
        board.offer(topic, payload)

    device = broker.connect(EVIL)
    with ViewTap(broker.connect("pfl-coord-default"), FLEET, offer) as engine:
        received: list[str] = []
        engine.subscribe(
            topics.device_subscription(FLEET, "status"), lambda t, _: received.append(t)
        )
        # Execute: what the engine publishes, and a device's status it receives
        for topic, payload in honest[:-1]:
            engine.publish(topic, payload, retain=True)
        engine.publish(topics.run_history(FLEET), b"the board's failure is not the engine's")
        engine.publish(topics.round_announcement(FLEET), b"not a view topic")
        device.publish(*honest[-1])
        engine.wait_until(lambda: bool(received), 5.0)
        delivered = everything.wait(10.0)  # the board's own thread decodes
    # Assert: the engine's handler ran, the board took what the topics may carry
    assert delivered
    assert received == [topics.device(FLEET, EVIL, "status")]
    assert topics.round_announcement(FLEET) not in taken
    snapshot = board.snapshot()
    assert snapshot["coordinator"]["rounds"] == 5
    assert {row["device"] for row in snapshot["fleet"]} == {
        "dev-0000",
        "dev-0001",
        "dev-0002",
        EVIL,
    }
