"""Tests for the registry's online set: kept per change, copied for readers only when read."""

from __future__ import annotations

from coordinator.engine.registry import FleetRegistry
from protocols.messages import DeviceStatus
from tests.coordinator.test_device_usage import hello


def test_a_burst_of_hellos_copies_the_online_set_once_not_per_hello() -> None:
    # Arrange
    registry = FleetRegistry()
    # Act: 2,000 devices join, then a round reads the set many times
    for index in range(2000):
        registry.on_hello(hello(f"dev-{index:04d}"))
    reads = [registry.online_ids() for _ in range(100)]
    # Assert: one copy for all of it, the same object to every reader
    assert registry.online_copies == 1
    assert all(view is reads[0] for view in reads)
    assert len(reads[0]) == registry.online_count() == 2000


def test_the_online_set_follows_joins_and_last_wills() -> None:
    # Arrange
    registry = FleetRegistry()
    registry.on_hello(hello("a"))
    registry.on_hello(hello("b"))
    before = registry.online_ids()
    # Act
    registry.on_status(DeviceStatus(device_id="a", state="offline"))
    registry.on_status(DeviceStatus(device_id="b", state="training"))
    after = registry.online_ids()
    # Assert: a reader's earlier copy is unchanged; the new one drops the device that left
    assert before == {"a", "b"}
    assert after == {"b"}
    assert registry.online_count() == 1
    assert registry.online_copies == 2
    assert registry.count_broadcast(5) == 5
