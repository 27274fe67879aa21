"""One aggregator of the tier: its group's updates checked like the coordinator's intake does."""

from __future__ import annotations

from typing import Any

import torch

from coordinator.tier import wire
from coordinator.tier.group import GroupAggregator, hashed_member, listed_member
from protocols import topics
from protocols.codec import describe_tensors, encode_frame, encode_tensors_frame
from protocols.messages import DeviceStatus, DeviceUpdate, RoundAnnouncement, SecureRound
from protocols.transport.inprocess import InProcessBroker

FLEET = "f"
RUN = "0" * 32
SPECS = describe_tensors({"w": torch.zeros(3)})


def _round(
    hub: InProcessBroker,
    selected: tuple[str, ...],
    clip: float = 10.0,
    secure: SecureRound | None = None,
) -> None:
    coordinator = hub.connect("coordinator")
    plan = wire.TierPlan(
        run_id=RUN,
        round_id=1,
        algorithm="fedavg",
        specs=SPECS,
        declared=dict.fromkeys(selected, 10),
        equal_weights=False,
        clip_norm=clip,
    )
    announcement = RoundAnnouncement(
        run_id=RUN,
        round_id=1,
        phase="train",
        algorithm="fedavg",
        model_sha256="0" * 64,
        selected=selected,
        secure=secure,
    )
    coordinator.publish(wire.plan_topic(FLEET), wire.encode(plan), retain=True)
    coordinator.publish(topics.round_announcement(FLEET), encode_frame(announcement), retain=True)


def _update(device_id: str, values: list[float], **changes: Any) -> tuple[str, bytes]:
    def header(manifest: Any) -> DeviceUpdate:
        fields: dict[str, Any] = {
            "run_id": RUN,
            "round_id": 1,
            "device_id": device_id,
            "algorithm": "fedavg",
            "num_samples": 10,
            "train_loss": 0.5,
            "manifest": manifest,
            **changes,
        }
        return DeviceUpdate(**fields)

    frame = encode_tensors_frame(header, {"w": torch.tensor(values)})
    return topics.device(FLEET, device_id, "update"), frame


def _partials(hub: InProcessBroker) -> list[tuple[wire.PartialAggregate, bytes]]:
    seen: list[tuple[wire.PartialAggregate, bytes]] = []
    listener = hub.connect("listener")

    def keep(topic: str, payload: bytes) -> None:
        message, blob = wire.decode(payload, 1 << 20)
        assert isinstance(message, wire.PartialAggregate)
        seen.append((message, blob))

    listener.subscribe(wire.partial_subscription(FLEET), keep)
    return seen


def test_the_group_sums_its_clipped_updates_and_drops_the_forged_ones() -> None:
    # Prepare
    hub = InProcessBroker()
    aggregator = GroupAggregator(hub.connect("agg"), FLEET, "a", listed_member(["d1", "d2", "d3"]))
    aggregator.start()
    seen = _partials(hub)
    device = hub.connect("devices")
    _round(hub, ("d1", "d2", "d3", "d4"), clip=5.0)
    # Execute
    for topic, frame in [
        _update("d1", [3.0, 4.0, 0.0]),  # norm 5: kept as is
        _update("d2", [0.0, 0.0, 10.0], algorithm="fedprox"),  # another algorithm: dropped
        _update("d2", [0.0, 0.0, 10.0], num_samples=11),  # more than declared: dropped
        _update("d2", [0.0, 0.0, 10.0]),  # norm 10: clipped to 5
        _update("d4", [1.0, 1.0, 1.0]),  # another group's device: not read
        _update("d1", [9.0, 9.0, 9.0]),  # a second update: dropped
    ]:
        device.publish(topic, frame)
    status = DeviceStatus(device_id="d3", state="skipped", round_id=1, run_id=RUN)
    device.publish(topics.device(FLEET, "d3", "status"), encode_frame(status))
    hub.pump(lambda: bool(seen))
    # Assert: one partial, once d3 declined
    ((partial, blob),) = seen
    sums = wire.partial_sums(partial, blob, SPECS)
    assert partial.devices == ("d1", "d2")
    assert (partial.weight, partial.samples, partial.loss_sum) == (20.0, 20, 10.0)
    assert torch.allclose(sums["w"], torch.tensor([30.0, 40.0, 50.0], dtype=torch.float64))
    assert aggregator.offences.count("d2") == 2
    assert aggregator.offences.count("d1") == 1
    assert aggregator.offences.count("d4") == 0


def test_a_group_with_nobody_asked_sends_an_empty_partial_at_once() -> None:
    hub = InProcessBroker()
    GroupAggregator(hub.connect("agg"), FLEET, "b", listed_member(["d9"])).start()
    seen = _partials(hub)
    _round(hub, ("d1",))
    hub.pump(lambda: bool(seen))
    assert [p.devices for p, _ in seen] == [()]


def test_the_close_sends_what_came_in() -> None:
    hub = InProcessBroker()
    GroupAggregator(hub.connect("agg"), FLEET, "a", listed_member(["d1", "d2"])).start()
    seen = _partials(hub)
    _round(hub, ("d1", "d2"))
    device = hub.connect("devices")
    device.publish(*_update("d1", [1.0, 0.0, 0.0]))
    hub.pump(lambda: False)
    assert seen == []  # d2 has not answered
    close = wire.TierClose(run_id=RUN, round_id=1)
    device.publish(wire.close_topic(FLEET), wire.encode(close))
    hub.pump(lambda: bool(seen))
    assert [p.devices for p, _ in seen] == [("d1",)]


def test_hash_groups_split_the_fleet_into_disjoint_groups() -> None:
    groups = [hashed_member(i, 3) for i in range(3)]
    ids = [f"dev-{i:04d}" for i in range(300)]
    counts = [sum(member(d) for d in ids) for member in groups]
    assert sum(counts) == 300
    assert all(member(d) == hashed_member(i, 3)(d) for i, member in enumerate(groups) for d in ids)
    assert min(counts) > 70
