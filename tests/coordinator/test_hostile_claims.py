"""A device lying about its sample count or sending garbage is dropped, counted, and harmless."""

from __future__ import annotations

import json
import math

import torch

from coordinator.engine.rounds import EngineSettings
from coordinator.run.settings import SimulationSettings
from device_agent.capabilities import probe_capabilities
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import (
    DeviceHello,
    DeviceUpdate,
    FleetRow,
    FleetSummary,
    RoundAnnouncement,
)
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agent, hub_engine
from tests.wiretap import decoded_into

HONEST = 3


def _liar(broker: InProcessBroker, samples: int) -> list[str]:
    """A client with a device's identity: declares 10 samples, then answers rounds with lies."""
    transport = broker.connect("liar")
    sent: list[str] = []

    def on_round(topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if not isinstance(message, RoundAnnouncement) or message.phase != "train":
            return
        manifest, blob = pack_tensors({"bogus": torch.zeros(1)})
        header = DeviceUpdate(
            run_id=message.run_id,
            round_id=message.round_id,
            device_id="liar",
            algorithm=message.algorithm,
            num_samples=samples,
            train_loss=0.0,
            manifest=manifest,
        )
        update = topics.device("default", "liar", "update")
        transport.publish(update, encode_frame(header, blob))
        raw = json.loads(header.model_dump_json())  # a count beyond the wire's bound
        raw["num_samples"] = 10**30
        body = json.dumps(raw).encode()
        transport.publish(update, b"PFL\x01" + len(body).to_bytes(4, "big") + body + blob)
        transport.publish(update, b"not a frame at all")
        sent.append(message.algorithm)

    transport.subscribe(topics.round_announcement("default"), on_round)
    hello = DeviceHello(
        device_id="liar", task="sine", num_train_samples=10, capabilities=probe_capabilities()
    )
    transport.publish(topics.device("default", "liar", "hello"), encode_frame(hello))
    return sent


def test_lies_about_counts_and_garbage_are_dropped_counted_and_change_nothing() -> None:
    task = load_task("sine")
    broker = InProcessBroker()
    settings = SimulationSettings.load(None, task="sine", algorithm="fedavg", devices=HONEST)
    coordinator = hub_engine(
        broker, settings, EngineSettings(task="sine", rounds=2, quorum=0.5, round_timeout_s=1.0)
    )
    coordinator.start()
    for index, data in enumerate(task.make_fleet(HONEST, PartitionSpec(), 0)):
        hub_agent(broker, f"dev-{index}", task, data).start()
    seen: list[FleetSummary] = []
    rows: list[FleetRow] = []
    watcher = broker.connect("operator")
    watcher.subscribe(topics.fleet_status("default"), decoded_into(FleetSummary, seen))
    watcher.subscribe(topics.fleet_row("default"), decoded_into(FleetRow, rows))
    sent = _liar(broker, samples=10**6)
    assert coordinator.wait_for_devices(HONEST + 1, 2.0)
    records = [coordinator.run_round() for _ in range(2)]
    assert sent == ["fedavg", "fedavg"]
    assert [r.participants for r in records] == [HONEST, HONEST]
    assert all(math.isfinite(float(v.abs().max())) for v in coordinator.shared.values())
    assert coordinator.offences.counts() == {"liar": 6}
    assert watcher.wait_until(lambda: bool(seen) and seen[-1].round_id == 2, 2.0)
    assert {r.device.device_id: r.device.dropped for r in rows}["liar"] == 6  # its last row
