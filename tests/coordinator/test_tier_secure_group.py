"""A group too small for secure aggregation sits the round out with an empty partial."""

from __future__ import annotations

from coordinator.tier import wire
from coordinator.tier.group import GroupAggregator, listed_member
from protocols.messages import SecureRound
from protocols.transport.inprocess import InProcessBroker
from tests.coordinator.test_tier_group import FLEET, SPECS, _partials, _round

SECURE = SecureRound(threshold=0.6, cohort=5, min_survivors=3, clip_norm=1.0, value_bound=1.0)


def test_two_of_the_cohort_in_a_group_send_no_sum_that_would_tell_each_the_others() -> None:
    # Prepare
    hub = InProcessBroker()
    aggregator = GroupAggregator(hub.connect("agg"), FLEET, "a", listed_member(["d1", "d2"]))
    aggregator.start()
    seen = _partials(hub)
    told: list[str] = []
    hub.connect("devices").subscribe(f"pfl/{FLEET}/secure/#", lambda topic, _: told.append(topic))
    # Execute
    _round(hub, ("d1", "d2", "d3", "d4", "d5"), clip=1.0, secure=SECURE)
    hub.pump(lambda: bool(seen))
    # Assert: an empty partial at once; no roster or unmasking went to any device
    ((partial, blob),) = seen
    assert (partial.devices, partial.weight, partial.samples) == ((), 0.0, 0)
    assert float(wire.partial_sums(partial, blob, SPECS)["w"].abs().sum()) == 0.0
    status = aggregator.status()
    assert (status.asked, status.devices, status.partial_sent) == (2, 0, True)
    assert told == []
