"""The paged fleet status on a real broker: rows sent only on change, cleared, joined by readers."""

from __future__ import annotations

import time

import pytest

from coordinator.engine import fleet_view
from coordinator.engine.fleet_view import FleetPages, fleet_status
from coordinator.engine.registry import FleetRegistry
from coordinator.ops.status import FleetView, collect_fleet_view
from coordinator.ops.status_pages import PagedFleet
from protocols import topics
from protocols.codec import decode_frame, encode_frame
from protocols.messages import (
    Capabilities,
    DeviceHello,
    DeviceStatus,
    FleetDevice,
    FleetRow,
    FleetSummary,
)
from protocols.offences import Offences
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.wiretap import Inbox

FLEET = "lab"
QUIET_S = 0.5


def _hello(device_id: str) -> DeviceHello:
    capabilities = Capabilities(
        cores=1, memory_bytes=1, arch="x", torch_version="2", python_version="3"
    )
    return DeviceHello(
        device_id=device_id, task="t", num_train_samples=10, capabilities=capabilities
    )


class _Tap:
    """A subscriber to the fleet status's topics on the broker, counting what arrives."""

    def __init__(self, url: str, name: str) -> None:
        self.transport = MqttTransport(BrokerSettings(url=url), name, clean_start=True)
        self.inbox = Inbox()
        self.transport.subscribe(topics.fleet_status(FLEET), self.inbox)
        self.transport.subscribe(topics.fleet_row(FLEET), self.inbox)

    def settle(self, count: int) -> list[tuple[str, bytes]]:
        """Wait for `count` messages in all, then a quiet spell: every one received."""
        assert self.transport.wait_until(lambda: len(self.inbox.messages) >= count, 10)
        time.sleep(QUIET_S)
        return list(self.inbox.messages)


def _rows(messages: list[tuple[str, bytes]]) -> dict[str, bytes]:
    return {t.rsplit("/", 1)[1]: p for t, p in messages if t != topics.fleet_status(FLEET)}


def test_a_round_publishes_only_the_rows_that_changed_and_the_summary(
    mosquitto: Mosquitto,
) -> None:
    # Arrange: three devices, their rows published once
    registry, offences = FleetRegistry(), Offences()
    for device_id in ("d1", "d2", "d3"):
        registry.on_hello(_hello(device_id))
    tap = _Tap(mosquitto.url, "pages-tap")
    with MqttTransport(BrokerSettings(url=mosquitto.url), "pfl-coord-pages") as coordinator:
        pages = FleetPages(FLEET, coordinator, registry)
        pages.publish(1, offences, held=set(), flapping=set(), scalars={})
        first = tap.settle(4)
        # Act: round 2, where only d2 sends an update and broadcasts reach everyone
        registry.count_broadcast(100)
        registry.on_update("d2", 2, 0.25)
        pages.publish(2, offences, held=set(), flapping=set(), scalars={"s": 1.0})
        second = tap.settle(len(first) + 2)[len(first) :]
        # Act: round 3, where nothing changed for any device
        pages.publish(3, offences, held=set(), flapping=set(), scalars={})
        third = tap.settle(len(first) + 3)[len(first) + 2 :]

    # Assert: all rows once, then only d2's row, then only the summary
    assert sorted(_rows(first)) == ["d1", "d2", "d3"]
    assert [t for t, _ in second] == [topics.fleet_row(FLEET, "d2"), topics.fleet_status(FLEET)]
    assert [t for t, _ in third] == [topics.fleet_status(FLEET)]
    summary, _ = decode_frame(third[0][1])
    assert isinstance(summary, FleetSummary)
    assert (summary.round_id, summary.registered, summary.online) == (3, 3, 3)
    assert summary.broadcast_bytes == 100
    assert pages.rows_published == 4


def test_rows_join_into_the_same_status_the_registry_shows(mosquitto: Mosquitto) -> None:
    # Arrange: usage, broadcasts before and after rows were sent, an offence, a quarantine
    registry, offences = FleetRegistry(), Offences()
    for device_id in ("d1", "d2"):
        registry.on_hello(_hello(device_id))
    offences.record("d1", "t", "malformed")
    url = mosquitto.url
    with MqttTransport(BrokerSettings(url=url), "pfl-coord-join") as coordinator:
        pages = FleetPages(FLEET, coordinator, registry)
        registry.count_broadcast(10)
        registry.asked(1)
        registry.on_update("d1", 1, 0.5)
        registry.count_up("d1", 300)
        registry.count_down({"d2": 50})
        pages.publish(1, offences, held={"d1"}, flapping=set(), scalars={})
        registry.count_broadcast(7)  # reaches both; neither row is sent again
        registry.missed_deadline(2, ["d2"])
        pages.publish(2, offences, held={"d1"}, flapping=set(), scalars={"x": 2.0})
        assert coordinator.flush(5)
        # Act: a reader joins what the broker retained
        view = collect_fleet_view(BrokerSettings(url=url), FLEET, listen_s=1.0)

    # Assert: the same rows as the whole status built at once
    whole = fleet_status(
        FLEET, 2, registry, offences, held={"d1"}, flapping=set(), scalars={"x": 2.0}
    )
    assert view.fleet is not None
    assert view.fleet.devices == whole.devices
    assert view.fleet.scalars == {"x": 2.0}
    assert view.rows() == FleetView(FLEET, paged=PagedFleet.of(whole)).rows()
    assert view.stragglers() == ["d2"]
    assert [d.bytes_down for d in view.fleet.devices] == [17, 67]


def test_a_stranger_leaving_the_list_has_its_row_cleared(
    mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: room for one stranger
    monkeypatch.setattr(fleet_view, "MAX_LISTED_STRANGERS", 1)
    registry, offences = FleetRegistry(), Offences()
    registry.on_hello(_hello("d1"))
    url = mosquitto.url
    tap = _Tap(url, "clear-tap")
    with MqttTransport(BrokerSettings(url=url), "pfl-coord-clear") as coordinator:
        pages = FleetPages(FLEET, coordinator, registry)
        offences.record("x1", "t", "malformed")
        pages.publish(1, offences, held=set(), flapping=set(), scalars={})
        tap.settle(3)
        # Act: a stranger with more dropped messages takes the place
        for _ in range(3):
            offences.record("x2", "t", "malformed")
        pages.publish(2, offences, held=set(), flapping=set(), scalars={})
        received = tap.settle(6)[3:]
        late = _Tap(url, "late-tap")  # what the broker retains now
        retained = late.settle(3)

    # Assert: x1's row cleared with an empty retained payload, x2's listed; a late reader sees
    # d1 and x2 only
    assert (topics.fleet_row(FLEET, "x1"), b"") in received
    assert sorted(_rows(retained)) == ["d1", "x2"]
    row, _ = decode_frame(_rows(retained)["x2"])
    assert isinstance(row, FleetRow)
    assert row.stranger
    assert row.device.dropped == 3
    view = FleetView(FLEET)
    for topic, payload in tap.inbox.messages:
        view.offer(topic, payload)
    assert view.fleet is not None
    assert [d.device_id for d in view.fleet.devices] == ["d1", "x2"]
    assert view.refused == 0


def test_a_reader_refuses_forged_rows_and_ignores_an_earlier_runs() -> None:
    # Arrange: an honest summary and row
    device = FleetDevice(device_id="d1", online=True, last_seen=1.0)
    view = FleetView(FLEET)
    summary = FleetSummary(fleet=FLEET, epoch="aa", round_id=1, registered=1)
    assert view.offer(topics.fleet_status(FLEET), encode_frame(summary))
    assert view.offer(
        topics.fleet_row(FLEET, "d1"),
        encode_frame(FleetRow(fleet=FLEET, epoch="aa", device=device)),
    )
    # Act: a row naming another device than its topic, another fleet's row, an old run's row
    ghost = device.model_copy(update={"device_id": "ghost"})
    wrong_device = view.offer(
        topics.fleet_row(FLEET, "d2"), encode_frame(FleetRow(fleet=FLEET, epoch="aa", device=ghost))
    )
    wrong_fleet = view.offer(
        topics.fleet_row(FLEET, "d1"),
        encode_frame(FleetRow(fleet="other", epoch="aa", device=device)),
    )
    stale = FleetRow(fleet=FLEET, epoch="bb", device=ghost)
    kept = view.offer(topics.fleet_row(FLEET, "ghost"), encode_frame(stale))
    # Assert: the forged two refused and counted; the stale row kept but not shown
    assert (wrong_device, wrong_fleet, kept) == (False, False, True)
    assert view.refused == 2
    assert view.fleet is not None
    assert [d.device_id for d in view.fleet.devices] == ["d1"]


def test_broadcasts_count_for_the_devices_online_then_settled_without_a_write_per_device() -> None:
    # Arrange
    registry = FleetRegistry()
    registry.on_hello(_hello("d1"))
    registry.on_hello(_hello("d2"))
    registry.drain_changed()
    # Act: d1 is offline for the second broadcast only
    assert registry.count_broadcast(10) == 20
    registry.on_status(DeviceStatus(device_id="d1", state="offline"))
    assert registry.count_broadcast(5) == 5
    registry.on_hello(_hello("d1"))
    registry.count_broadcast(3)
    # Assert: each device's total as before; a broadcast changes no device's row
    usage = registry.usage()
    assert (usage["d1"].bytes_down, usage["d2"].bytes_down) == (13, 18)
    assert registry.drain_changed() == {"d1"}  # its leave and rejoin, not the broadcasts
    settled, mark = registry.row_usage("d1")
    assert settled.bytes_down + registry.broadcast_bytes() - (mark or 0) == 13
    assert registry.row_usage("d2")[1] == 0  # online since before the first broadcast


def test_the_planning_snapshot_is_rebuilt_only_when_planning_would_see_a_change() -> None:
    # Arrange
    registry = FleetRegistry()
    for device_id in ("d1", "d2"):
        registry.on_hello(_hello(device_id))
    first = registry.snapshot()
    # Act: a round's update and a loss change nothing planning reads
    registry.on_update("d1", 1, 0.5)
    same = registry.snapshot()
    registry.on_status(DeviceStatus(device_id="d2", state="offline"))
    after = registry.snapshot()
    # Assert
    assert same is first
    assert after is not first
    assert [(d.device_id, d.online) for d in after.devices] == [("d1", True), ("d2", False)]
