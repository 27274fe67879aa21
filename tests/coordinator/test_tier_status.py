"""`pfl-coord status` shows each aggregator of the tier: its group, last round, devices, partial."""

from __future__ import annotations

from coordinator.ops.status import FleetView
from coordinator.tier import wire
from coordinator.tier.group import GroupAggregator, listed_member
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import DeviceStatus
from protocols.transport.inprocess import InProcessBroker
from tests.coordinator.test_tier_group import FLEET, RUN, _partials, _round, _update


def _viewed(hub: InProcessBroker) -> FleetView:
    """A fleet view fed every aggregator status the hub carries (as `pfl-coord status` is)."""
    view = FleetView(FLEET)

    def take(topic: str, payload: bytes) -> None:
        view.offer(topic, payload)

    hub.connect("status").subscribe(topics.aggregator_status(FLEET), take)
    return view


def test_the_view_shows_each_aggregators_group_and_last_round() -> None:
    # Prepare
    hub = InProcessBroker()
    group = listed_member(["d1", "d2", "d3"])
    GroupAggregator(hub.connect("agg"), FLEET, "a", group, group="3 listed devices").start()
    view = _viewed(hub)
    seen = _partials(hub)
    hub.pump(lambda: bool(view.aggregators.statuses))
    before = view.aggregators.rows()
    device = hub.connect("devices")
    # Execute: d1 and d2 answer, d3 skips
    _round(hub, ("d1", "d2", "d3", "d4"))
    for topic, frame in (_update("d1", [1.0, 0.0, 0.0]), _update("d2", [0.0, 1.0, 0.0])):
        device.publish(topic, frame)
    status = DeviceStatus(device_id="d3", state="skipped", round_id=1, run_id=RUN)
    device.publish(topics.device(FLEET, "d3", "status"), encode_frame(status))
    hub.pump(lambda: bool(seen))
    hub.pump(lambda: view.aggregators.rows()[0]["partial_sent"])
    # Assert: online with no round at first; then round 1, 2 of its 3 asked devices in the sum
    assert [(r["aggregator"], r["round"], r["partial_sent"]) for r in before] == [
        ("a", None, False)
    ]
    (row,) = view.aggregators.rows()
    assert row["group"] == "3 listed devices"
    assert (row["state"], row["round"], row["asked"], row["devices"]) == ("online", 1, 3, 2)
    assert (row["partial_sent"], row["partials_sent"]) == (True, 1)
    assert view.as_json()["aggregators"] == [row]
    assert seen[0][0].devices == ("d1", "d2")


def test_a_status_under_another_aggregators_name_or_garbled_is_refused() -> None:
    # Prepare
    view = FleetView(FLEET)
    forged = wire.encode(wire.AggregatorStatus(aggregator="b", round_id=7))
    # Execute
    taken = [
        view.offer(wire.status_topic(FLEET, "a"), forged),  # b's status on a's topic
        view.offer(wire.status_topic(FLEET, "a"), b"PFLT\x00\x00\x00\x02{}"),
        view.offer(wire.status_topic("other", "b"), forged),  # another fleet's: passed over
        view.offer(wire.status_topic(FLEET, "b"), forged),
    ]
    # Assert
    assert taken == [False, False, False, True]
    assert view.refused == 2
    assert [r["aggregator"] for r in view.aggregators.rows()] == ["b"]
