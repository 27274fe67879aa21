"""An asynchronous announcement lets a device train on a newer model than it names."""

from __future__ import annotations

from coordinator.strategies.base import RoundPlan
from protocols import topics
from protocols.codec import decode_frame
from protocols.messages import DeviceUpdate
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents, hub_coordinator
from tests.wiretap import decoded_into


def _updates(broker: InProcessBroker) -> list[DeviceUpdate]:
    seen: list[DeviceUpdate] = []
    tap = broker.connect("tap")
    tap.subscribe(
        topics.device_subscription("default", "update"),
        decoded_into(DeviceUpdate, seen),
    )
    return seen


def _announce_then_move_the_model_on(asynchronous: bool) -> list[DeviceUpdate]:
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", devices=1, rounds=3)
    coordinator.start()
    hub_agents(broker, ["dev-0000"])
    seen = _updates(broker)
    broker.pump(lambda: False)
    # the device is asked for round 1 on model 0 ...
    coordinator.announce(1, "train", RoundPlan(("dev-0000",)), asynchronous=asynchronous)
    # ... but before it fetches, the model moves on to version 1 (another device's update)
    coordinator.model = {k: v + 0.01 for k, v in coordinator.model.items()}
    coordinator.round_id = 1
    coordinator.publish_model()
    broker.pump(lambda: False)
    return seen


def test_an_async_device_trains_on_the_newer_model_it_finds() -> None:
    seen = _announce_then_move_the_model_on(asynchronous=True)
    assert [(u.device_id, u.round_id) for u in seen] == [("dev-0000", 1)]


def test_a_sync_device_waits_for_the_announced_model_instead() -> None:
    assert _announce_then_move_the_model_on(asynchronous=False) == []


def test_an_evaluation_announced_while_an_async_job_waits_for_its_model_replaces_nothing() -> None:
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", devices=1, rounds=3)
    coordinator.start()
    hub_agents(broker, ["dev-0000"])
    seen = _updates(broker)
    reports: list[object] = []
    tap = broker.connect("eval-tap")
    tap.subscribe(
        topics.device_subscription("default", "evaluation"),
        lambda _topic, payload: reports.append(decode_frame(payload)[0]),
    )
    broker.pump(lambda: False)
    coordinator.model = {k: v + 0.01 for k, v in coordinator.model.items()}
    coordinator.round_id = 1
    coordinator.publish_model()  # the device holds model 0 only: the job must fetch model 1
    coordinator.announce(2, "train", RoundPlan(("dev-0000",)), asynchronous=True)
    coordinator.announce(1, "evaluate", None)  # before the device has even seen the job
    broker.pump(lambda: False)
    assert [(u.device_id, u.round_id) for u in seen] == [("dev-0000", 2)]
    assert len(reports) == 1
