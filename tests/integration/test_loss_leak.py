"""Under DP or secure aggregation no device's exact loss reaches any topic: statuses, fleet status.

A real run on the in-process hub with a spy subscribed to the whole fleet: round 1 trains, then
one device says "online" again, one declines round 2 ("skipped"), round 2 runs (fleet status),
and one device leaves ("offline"). The spy reads every header published.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine.registry import FleetRegistry
from device_agent.agent import DeviceAgent, device_will
from device_agent.eligibility import EligibilityPolicy
from protocols import topics
from protocols.codec import decode_frame, encode_frame
from protocols.messages import (
    Command,
    DeviceHello,
    DeviceStatus,
    ExportArguments,
)
from protocols.transport.base import Transport, TransportWrapper
from protocols.transport.inprocess import InProcessBroker
from tests.device_agent.test_egress import device_hello
from tests.hub_fleet import hub_agents, hub_coordinator

DEVICES = ("dev-a", "dev-b", "dev-c", "dev-d")


@dataclass(frozen=True)
class AlwaysBusy(EligibilityPolicy):
    """A device that declines every training round from now on."""

    def reason_to_skip(self) -> str | None:
        """Always a reason."""
        return "busy"


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield float(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _numbers(item)


def _record_losses(agent: DeviceAgent, losses: dict[str, float]) -> None:
    """Note each training result's exact loss as the device computed it, before privacy."""
    privatize = agent.contexts.privatize

    def noting(announcement: Any, result: Any) -> Any:
        losses[agent.device_id] = result.train_loss
        return privatize(announcement, result)

    agent.contexts.privatize = noting  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "run",
    [
        {"dp_noise": 1.0},
        {"secagg": True},
        {"dp_noise": 1.0, "dp_placement": "device", "secagg": True},
    ],
    ids=["dp", "secagg", "dp-on-device-under-secagg"],
)
def test_no_exact_loss_leaves_a_device_under_dp_or_secure_aggregation(run: dict[str, Any]) -> None:
    # Prepare: four devices, a spy on every topic, each device's round-1 loss noted
    broker = InProcessBroker()
    headers: list[tuple[str, dict[str, Any]]] = []

    def spy(topic: str, payload: bytes) -> None:
        header, _ = decode_frame(payload)
        headers.append((topic, json.loads(header.model_dump_json())))

    broker.connect("spy").subscribe("pfl/#", spy)
    coordinator = hub_coordinator(broker, "fedavg", len(DEVICES), 2, run=run)
    agents = hub_agents(broker, DEVICES)
    losses: dict[str, float] = {}
    for agent in agents:
        _record_losses(agent, losses)
    coordinator.start()
    coordinator.wait_for_devices(len(DEVICES), 1.0)

    # Execute: round 1; a rejoin, a decline of round 2, round 2, a device leaving
    coordinator.run_round()
    agents[1].rejoin()
    agents[0].eligibility = AlwaysBusy()
    coordinator.run_round()
    agents[2].stop()
    coordinator.transport.wait_until(lambda: False, 0.1)

    # Assert: every device trained; no header anywhere carries one of their losses
    assert set(losses) == set(DEVICES)
    assert all(loss > 0 for loss in losses.values())
    kinds = {header["kind"] for _, header in headers}
    assert {"status", "fleet-summary", "fleet-row"} <= kinds
    skipped = [h for _, h in headers if h["kind"] == "status" and h["state"] == "skipped"]
    assert [h["device_id"] for h in skipped] == ["dev-a"]
    leaked = [
        (topic, header["kind"])
        for topic, header in headers
        if any(number in losses.values() for number in _numbers(header))
    ]
    assert leaked == []
    rows = [h["device"] for _, h in headers if h["kind"] == "fleet-row"]
    assert {row["device_id"] for row in rows} >= set(DEVICES)
    assert all(row["last_loss"] is None for row in rows)


class Recording(TransportWrapper):
    """Notes every payload an agent publishes, whichever code path publishes it."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.published: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Note, then publish."""
        self.published.append((topic, payload))
        self.inner.publish(topic, payload, retain=retain)


def test_everything_an_agent_publishes_passes_its_egress_gate(tmp_path: Path) -> None:
    # Prepare: agents whose publishes and whose gate's frames are both noted
    broker = InProcessBroker()
    run = {"dp_noise": 1.0, "dp_placement": "device", "secagg": True}
    coordinator = hub_coordinator(broker, "fedavg", len(DEVICES), 1, run=run)
    taps = [Recording(broker.connect(device_id)) for device_id in DEVICES]
    agents = hub_agents(broker, DEVICES, lambda i: {"transport": taps[i]})
    vetted: set[bytes] = set()
    for agent in agents:
        send = agent.egress.send

        def noting(*args: Any, _send: Any = send, **kwargs: Any) -> bytes | None:
            frame: bytes | None = _send(*args, **kwargs)
            if frame is not None:
                vetted.add(frame)
            return frame

        agent.egress.send = noting  # type: ignore[method-assign]
    marks = [len(tap.published) for tap in taps]  # the start's hello went out before the note
    for agent in agents:
        agent.rejoin()  # its status and hello again, noted
    coordinator.start()
    coordinator.wait_for_devices(len(DEVICES), 1.0)

    # Execute: a secure private round, an evaluation, an export, a leaving device
    coordinator.run_round()
    coordinator.evaluate(final=True)
    command = Command(action="export", export=ExportArguments(out_dir=str(tmp_path)))
    broker.connect("operator").publish(topics.command("default", "dev-b"), encode_frame(command))
    coordinator.transport.wait_until(lambda: False, 0.1)
    agents[3].stop()

    # Assert: every message kind a device sends in such a run went out, all through the gate
    sent = [entry for tap, mark in zip(taps, marks, strict=True) for entry in tap.published[mark:]]
    kinds = {decode_frame(payload)[0].kind for _, payload in sent}
    assert kinds >= {
        "hello", "status", "update", "evaluation", "export-report", "secagg-keys",
        "secagg-shares", "secagg-reveal",
    }  # fmt: skip
    bypassed = [(topic, decode_frame(p)[0].kind) for topic, p in sent if p not in vetted]
    assert bypassed == []


def test_strict_devices_declare_one_sample_train_under_dp_and_decline_the_rest() -> None:
    # Prepare: two strict devices and two lenient ones, a spy on their hellos
    broker = InProcessBroker()
    hellos: dict[str, int] = {}

    def spy(topic: str, payload: bytes) -> None:
        hello, _ = decode_frame(payload)
        assert isinstance(hello, DeviceHello)
        hellos[hello.device_id] = hello.num_train_samples

    broker.connect("spy").subscribe(topics.device_subscription("default", "hello"), spy)
    private = hub_coordinator(broker, "fedavg", len(DEVICES), 1, run={"dp_noise": 1.0})
    agents = hub_agents(broker, DEVICES, lambda i: {"strict_egress": i < 2})
    private.start()
    private.wait_for_devices(len(DEVICES), 1.0)

    # Execute: a DP round and an evaluation, then a round of a run without DP
    trained = private.run_round()
    reports, _ = private.evaluate(final=True)
    private.transport.close()
    plain = hub_coordinator(broker, "fedavg", len(DEVICES), 1)
    plain.start()
    plain.wait_for_devices(len(DEVICES), 1.0)
    untrusted = plain.run_round()

    # Assert: strict devices said 1 sample, trained under DP only, evaluated never
    assert hellos["dev-a"] == hellos["dev-b"] == 1
    assert hellos["dev-c"] == len(agents[2].data.train) > 1
    assert trained.participants == len(DEVICES)
    assert sorted(r.device_id for r in reports) == ["dev-c", "dev-d"]
    assert untrusted.participants == 2
    assert untrusted.skipped == 2


def test_a_strict_devices_will_carries_no_reason() -> None:
    will = device_will("default", "dev-a", strict_egress=True)
    status, _ = decode_frame(will.payload)
    assert isinstance(status, DeviceStatus)
    assert (status.state, status.detail) == ("offline", "")
    lenient, _ = decode_frame(device_will("default", "dev-a").payload)
    assert isinstance(lenient, DeviceStatus)
    assert lenient.detail == "connection lost"


def test_a_private_registry_keeps_no_loss_a_device_sends_anyway() -> None:
    # Prepare: a device that still reports losses (an older agent, or a hostile one)
    hello = device_hello("dev-a", 10)
    private, plain = FleetRegistry(keeps_losses=False), FleetRegistry()
    for registry in (private, plain):
        registry.on_hello(hello)
        registry.on_status(DeviceStatus(device_id="dev-a", state="skipped", last_loss=1.9113))
    # Execute / Assert: recorded only where losses may be shown
    assert [r.last_loss for r in private.records()] == [None]
    assert [r.last_loss for r in plain.records()] == [1.9113]
    private.on_update("dev-a", 1, 1.75)
    assert [r.last_loss for r in private.records()] == [None]
