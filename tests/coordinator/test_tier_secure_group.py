"""A group too small for secure aggregation sits the round out with an empty partial."""

from __future__ import annotations

from coordinator.tier import wire
from coordinator.tier.group import GroupAggregator, listed_member
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import RoundAnnouncement, SecureRound
from protocols.transport.inprocess import InProcessBroker
from tests.coordinator.test_tier_group import FLEET, RUN, SPECS, _partials

SECURE = SecureRound(threshold=0.6, cohort=5, min_survivors=3, clip_norm=1.0, value_bound=1.0)


def _secure_round(hub: InProcessBroker, selected: tuple[str, ...]) -> None:
    coordinator = hub.connect("coordinator")
    plan = wire.TierPlan(
        run_id=RUN,
        round_id=1,
        algorithm="fedavg",
        specs=SPECS,
        declared=dict.fromkeys(selected, 10),
        equal_weights=False,
        clip_norm=1.0,
    )
    announcement = RoundAnnouncement(
        run_id=RUN,
        round_id=1,
        phase="train",
        algorithm="fedavg",
        model_sha256="0" * 64,
        selected=selected,
        secure=SECURE,
    )
    coordinator.publish(wire.plan_topic(FLEET), wire.encode(plan), retain=True)
    coordinator.publish(topics.round_announcement(FLEET), encode_frame(announcement), retain=True)


def test_two_of_the_cohort_in_a_group_send_no_sum_that_would_tell_each_the_others() -> None:
    # Prepare
    hub = InProcessBroker()
    aggregator = GroupAggregator(hub.connect("agg"), FLEET, "a", listed_member(["d1", "d2"]))
    aggregator.start()
    seen = _partials(hub)
    told: list[str] = []
    hub.connect("devices").subscribe(f"pfl/{FLEET}/secure/#", lambda topic, _: told.append(topic))
    # Execute
    _secure_round(hub, ("d1", "d2", "d3", "d4", "d5"))
    hub.pump(lambda: bool(seen))
    # Assert: an empty partial at once; no roster or unmasking went to any device
    ((partial, blob),) = seen
    assert (partial.devices, partial.weight, partial.samples) == ((), 0.0, 0)
    assert float(wire.partial_sums(partial, blob, SPECS)["w"].abs().sum()) == 0.0
    status = aggregator.status()
    assert (status.asked, status.devices, status.partial_sent) == (2, 0, True)
    assert told == []
