"""Tests for each device's bytes and round time, from the registry to the status rows."""

from __future__ import annotations

import time

from coordinator.engine.fleet_view import fleet_status
from coordinator.engine.registry import FleetRegistry
from coordinator.ops.status import FleetView
from coordinator.ops.status_pages import PagedFleet
from protocols.messages import Capabilities, DeviceHello
from protocols.offences import Offences


def hello(device_id: str) -> DeviceHello:
    capabilities = Capabilities(
        cores=1, memory_bytes=1, arch="x", torch_version="2", python_version="3"
    )
    return DeviceHello(
        device_id=device_id, task="t", num_train_samples=10, capabilities=capabilities
    )


def test_bytes_and_round_time_reach_the_fleet_status_and_its_rows() -> None:
    # Arrange: two devices online, one stranger that never said hello
    registry = FleetRegistry()
    for device_id in ("d1", "d2"):
        registry.on_hello(hello(device_id))

    # Act
    registry.count_up("d1", 100)
    registry.count_up("stranger", 5)  # not kept: any sender could claim any id
    total = registry.count_broadcast(7)
    downloads = registry.count_down({"d1": 1000, "d2": 0, "stranger": 9})
    before = time.time()
    registry.asked(3)
    registry.on_update("d1", 3, 0.5)
    registry.on_update("d2", 2, 0.5)  # an answer to an earlier round: no round time
    status = fleet_status("lab", 3, registry, Offences(), held=set(), flapping=set(), scalars={})

    # Assert
    assert (total, downloads) == (14, 1009)
    rows = {d.device_id: d for d in status.devices}
    assert set(rows) == {"d1", "d2"}
    assert (rows["d1"].bytes_up, rows["d1"].bytes_down) == (100, 1007)
    assert (rows["d2"].bytes_up, rows["d2"].bytes_down) == (0, 7)
    assert rows["d1"].round_seconds is not None
    assert 0 <= rows["d1"].round_seconds <= time.time() - before
    assert rows["d2"].round_seconds is None
    view = FleetView("lab", paged=PagedFleet.of(status))
    row = view.rows()[0]
    assert (row["bytes_up"], row["bytes_down"]) == (100, 1007)
    assert row["round_seconds"] == rows["d1"].round_seconds
