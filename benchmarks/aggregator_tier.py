"""The coordinator's cost per round with and without the aggregator tier, against fleet size.

One process, one in-process hub: the real coordinator (`build_coordinator`, FedAvg on the
`synthetic` task's model), the real aggregators (`GroupAggregator`, devices hashed to them) and
a stand-in fleet that answers each round with every selected device's update frame (a fixed
random delta per device, packed once; each round only its header is framed). Training is not
run: this measures what the coordinator does with updates, not what devices do to make them.

Everything runs on one thread, so each part's CPU time is the thread time spent in its own
message handlers; the coordinator's is the round's thread time minus the fleet's and the
aggregators'. Inbound bytes are the payloads the coordinator's handlers received in the round.
"Held" is the size of the update tensors the coordinator holds when it aggregates: each
device's decoded delta without the tier, each aggregator's float64 partial sum with it.

    OMP_NUM_THREADS=1 python -m benchmarks.aggregator_tier [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from benchmarks.common import markdown_table, one_thread, publish_section
from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from coordinator.tier.group import GroupAggregator, hashed_member
from coordinator.tier.uplink import TierUplink
from device_agent.capabilities import probe_capabilities
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import DeviceHello, DeviceUpdate, RoundAnnouncement, TensorManifest
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker

TASK = "synthetic"
MARKER = "<!-- aggregator-tier -->"
RUNS: tuple[tuple[int, float, int], ...] = (
    (1_000, 0.1, 0),
    (1_000, 0.1, 2),
    (1_000, 0.1, 8),
    (10_000, 0.1, 0),
    (10_000, 0.1, 2),
    (10_000, 0.1, 8),
)
"""(devices, participation, aggregators; 0: no tier)."""


@dataclass
class _Clock:
    """Thread CPU seconds spent in the handlers it wrapped."""

    seconds: float = 0.0

    def wrap(self, handler: Callable[[str, bytes], None]) -> Callable[[str, bytes], None]:
        def timed(topic: str, payload: bytes) -> None:
            started = time.thread_time()
            try:
                handler(topic, payload)
            finally:
                self.seconds += time.thread_time() - started

        return timed


@dataclass
class _TimedClient:
    """A hub client whose handlers are timed on `clock` (what an aggregator uses of one)."""

    inner: Transport
    clock: _Clock

    def subscribe(self, pattern: str, handler: Callable[[str, bytes], None]) -> None:
        self.inner.subscribe(pattern, self.clock.wrap(handler))

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.inner.publish(topic, payload, retain=retain)


class _TimedCoordinatorClient:
    """The coordinator's hub client: its handlers timed, and its waits (the hub delivers then)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.handlers = _Clock()
        self.waiting = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def subscribe(self, pattern: str, handler: Callable[[str, bytes], None]) -> None:
        self.inner.subscribe(pattern, self.handlers.wrap(handler))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        started = time.thread_time()
        try:
            return self.inner.wait_until(predicate, timeout_s)
        finally:
            self.waiting += time.thread_time() - started


@dataclass
class _Fleet:
    """Answers each train announcement with every selected device's update."""

    client: Transport
    blobs: dict[str, tuple[TensorManifest, bytes]]
    clock: _Clock = field(default_factory=_Clock)

    def start(self, fleet: str) -> None:
        self.client.subscribe(topics.round_announcement(fleet), self.clock.wrap(self._on_round))

    def hellos(self, fleet: str) -> None:
        capabilities = probe_capabilities()
        for device_id in self.blobs:
            hello = DeviceHello(
                device_id=device_id, task=TASK, num_train_samples=10, capabilities=capabilities
            )
            self.client.publish(topics.device(fleet, device_id, "hello"), encode_frame(hello))

    def _on_round(self, topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        assert isinstance(announcement, RoundAnnouncement)
        if announcement.phase != "train":
            return
        fleet = topic.split("/")[1]
        for device_id in announcement.selected:
            manifest, blob = self.blobs[device_id]
            update = DeviceUpdate(
                run_id=announcement.run_id,
                round_id=announcement.round_id,
                device_id=device_id,
                algorithm=announcement.algorithm,
                num_samples=10,
                train_loss=0.5,
                manifest=manifest,
            )
            frame = encode_frame(update, blob)
            self.client.publish(topics.device(fleet, device_id, "update"), frame)


def _held_bytes(coordinator: Coordinator, held: list[int]) -> None:
    """Record the update bytes each collection hands the engine (the deltas, or the partials)."""
    uplink = coordinator.uplink
    collect = uplink.collect

    def measured(host: Any, request: Any) -> Any:
        collected: Any = collect(host, request)
        if isinstance(uplink, TierUplink):
            held.append(int(collected.scalars["tier_partials"]) * _model_bytes(host) * 2)
        else:
            held.append(sum(t.nbytes for u in collected.updates for t in u.shared_delta.values()))
        return collected

    uplink.collect = measured  # type: ignore[method-assign]


def _model_bytes(host: Any) -> int:
    return sum(4 * max(1, int(torch.Size(s.shape).numel())) for s in host.specs)


def measure(devices: int, participation: float, groups: int, rounds: int) -> dict[str, float]:
    """Median per-round costs of one configuration."""
    names = ",".join(f"agg-{i}" for i in range(groups))
    settings = SimulationSettings.load(
        None, task=TASK, devices=devices, participation=participation, tier_aggregators=names
    )
    task = load_task(TASK)
    model = task.build_model(0)
    hub = InProcessBroker()
    client = _TimedCoordinatorClient(hub.connect("coordinator"))
    coordinator = build_coordinator(
        lambda: cast(Transport, client),
        plan_stages(settings, task, model),
        model,
        EngineSettings(task=TASK, rounds=rounds, quorum=0.5, round_timeout_s=600.0),
        task,
    )
    clocks = [_Clock() for _ in range(groups)]
    for index, clock in enumerate(clocks):
        timed = cast(Transport, _TimedClient(hub.connect(f"agg-{index}"), clock))
        GroupAggregator(timed, "default", f"agg-{index}", hashed_member(index, groups)).start()
    generator = torch.Generator().manual_seed(0)
    shared = coordinator.shared
    blobs = {
        f"dev-{i:05d}": pack_tensors(
            {n: 0.01 * torch.randn(t.shape, generator=generator) for n, t in shared.items()}
        )
        for i in range(devices)
    }
    fleet = _Fleet(hub.connect("fleet"), blobs)
    fleet.start("default")
    coordinator.start()
    fleet.hellos("default")
    assert coordinator.wait_for_devices(devices, 600.0)
    held: list[int] = []
    _held_bytes(coordinator, held)
    status = _Clock()
    publish_status = coordinator.publish_fleet_status

    def timed_status() -> None:
        started = time.thread_time()
        publish_status()
        status.seconds += time.thread_time() - started

    coordinator.publish_fleet_status = timed_status  # type: ignore[method-assign]
    tier = coordinator.uplink if isinstance(coordinator.uplink, TierUplink) else None
    rows: list[dict[str, float]] = []
    for _ in range(rounds):
        fleet.clock.seconds = status.seconds = client.handlers.seconds = client.waiting = 0.0
        for clock in clocks:
            clock.seconds = 0.0
        inbound = coordinator.traffic.bytes_up + (tier.bytes_in if tier else 0)
        started = time.thread_time()
        record = coordinator.run_round()
        total = time.thread_time() - started
        aggregators = sum(clock.seconds for clock in clocks)
        # its own: outside its waits, plus its handlers inside them (the rest of a wait is the
        # hub delivering messages, a broker's work in a deployment, and the others' handlers)
        own = total - client.waiting + client.handlers.seconds
        rows.append(
            {
                "updates": float(record.participants),
                "coordinator_s": own,
                "status_s": status.seconds,
                "aggregator_s": max((c.seconds for c in clocks), default=0.0),
                "aggregators_s": aggregators,
                "inbound": float(
                    coordinator.traffic.bytes_up + (tier.bytes_in if tier else 0) - inbound
                ),
                "held": float(held[-1]),
            }
        )
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def _size(value: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def main(argv: list[str] | None = None) -> None:
    """Measure every configuration of RUNS and publish the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    one_thread()
    rows = []
    for devices, participation, groups in RUNS:
        result = measure(devices, participation, groups, args.rounds)
        updates = result["updates"]
        per_update = result["aggregators_s"] / updates * 1e3 if groups else None
        rows.append(
            [
                f"{devices:,}",
                f"{updates:,.0f}",
                str(groups) if groups else "none",
                f"{result['coordinator_s'] * 1e3:,.0f} ms",
                f"{result['status_s'] * 1e3:,.0f} ms",
                _size(result["inbound"]),
                _size(result["held"]),
                f"{result['aggregator_s'] * 1e3:,.0f} ms" if groups else "-",
                f"{per_update:.2f} ms" if per_update is not None else "-",
            ]
        )
        print(rows[-1], flush=True)
    header = [
        "devices",
        "updates/round",
        "aggregators",
        "coordinator CPU/round",
        "of which fleet status",
        "coordinator inbound/round",
        "held at aggregation",
        "busiest aggregator CPU/round",
        "aggregator CPU/update",
    ]
    params = sum(t.numel() for t in load_task(TASK).build_model(0).state_dict().values())
    lines = [
        "## The aggregator tier: the coordinator's cost per round",
        "",
        "Without the tier the coordinator decodes and holds every update; with it, one partial "
        "aggregate per aggregator (docs/scaling.md). CPU is thread time (the machine is shared: "
        "timings vary by tens of percent between runs); bytes are exact.",
        "",
        *markdown_table(header, rows),
        "",
        f"FedAvg on the {TASK} task's model ({params:,} float32 parameters), participation 0.1, "
        f"median of {args.rounds} rounds, one thread: "
        "`OMP_NUM_THREADS=1 python -m benchmarks.aggregator_tier`. The devices are a stand-in "
        "that sends each selected device's update frame (no training); the coordinator and "
        "aggregators are the real ones on the in-process hub.",
    ]
    if args.out is not None:
        publish_section(args.out, MARKER, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
