"""The coordinator's cost per round with and without the aggregator tier, up to 100,000 devices.

Each configuration runs in a fresh process (so its resident memory is its own), on one thread
and one in-process hub: the real coordinator (`build_coordinator`, FedAvg on the `synthetic`
task's model), the real aggregators (`GroupAggregator`, devices hashed to them) and a stand-in
fleet light enough for 100,000 registered devices on one machine: it holds only the device ids,
sends every hello once, and for each round builds the update frame of each *selected* device
only (a random delta drawn from the device's index as seed, packed when asked). Training is not
run: this measures what the coordinator does with a fleet, not what devices do.

Each part's CPU time is the thread time spent in its own message handlers; the coordinator's is
the round's thread time minus its waits, plus its handlers inside them (the rest of a wait is
the hub delivering, a broker's work in a deployment, and the fleet's and aggregators' handlers).
Inbound bytes are the payloads the coordinator's handlers received in the round. "Held" is the
size of the update tensors the coordinator holds when it aggregates. Memory is the process's
resident set (psutil): once built, once every device registered, and its peak after the rounds;
the stand-in fleet holds only ids, so what registration adds is the coordinator's registry.

    OMP_NUM_THREADS=1 python -m benchmarks.aggregator_tier [--out docs/benchmarks.md]
        [--plot docs/aggregator_tier.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil
import torch

from benchmarks import aggregator_tier_report as report
from benchmarks.aggregator_tier_report import Run
from benchmarks.common import one_thread, publish_section
from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from coordinator.tier.group import GroupAggregator, hashed_member
from coordinator.tier.uplink import TierUplink
from device_agent.capabilities import probe_capabilities
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import DeviceHello, DeviceUpdate, RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker

TASK = "synthetic"
MARKER = "<!-- aggregator-tier -->"
RUNS: tuple[tuple[int, float, int], ...] = (
    *((devices, 0.1, groups) for devices in (1_000, 10_000, 100_000) for groups in (0, 1, 2, 4)),
    (100_000, 0.01, 0),
    (100_000, 0.01, 4),
)
"""(devices, participation, aggregators; 0: no tier)."""
QUICK: tuple[tuple[int, float, int], ...] = ((1_000, 0.1, 0), (1_000, 0.1, 2))


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
        self.status_bytes = 0
        self.status_messages = 0

    def publish(self, topic: str, payload: bytes, **options: Any) -> None:
        """Publish, counting what goes to the fleet status's topics (summary and rows)."""
        if topic.startswith(topics.fleet_status(topic.split("/")[1])):
            self.status_bytes += len(payload)
            self.status_messages += 1
        self.inner.publish(topic, payload, **options)

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
    """A pool of `size` stand-in devices: ids only; a selected device's update made when asked."""

    client: Transport
    size: int
    shapes: dict[str, torch.Size]
    clock: _Clock = field(default_factory=_Clock)

    @staticmethod
    def device_id(index: int) -> str:
        return f"dev-{index:06d}"

    def start(self, fleet: str) -> None:
        self.client.subscribe(topics.round_announcement(fleet), self.clock.wrap(self._on_round))

    def hellos(self, fleet: str) -> None:
        capabilities = probe_capabilities()
        for index in range(self.size):
            device_id = self.device_id(index)
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
            generator = torch.Generator().manual_seed(int(device_id.removeprefix("dev-")))
            delta = {n: 0.01 * torch.randn(s, generator=generator) for n, s in self.shapes.items()}
            manifest, blob = pack_tensors(delta)
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


def _rss() -> float:
    return float(psutil.Process().memory_info().rss)


def measure(devices: int, participation: float, groups: int, rounds: int) -> dict[str, float]:
    """Median per-round costs of one configuration, and its process's memory."""
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
    shapes = {name: tensor.shape for name, tensor in coordinator.shared.items()}
    fleet = _Fleet(hub.connect("fleet"), devices, shapes)
    fleet.start("default")
    coordinator.start()
    built = _rss()
    fleet.hellos("default")
    assert coordinator.wait_for_devices(devices, 3600.0)
    registered = _rss()
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
        client.status_bytes = client.status_messages = 0
        for clock in clocks:
            clock.seconds = 0.0
        inbound = coordinator.traffic.bytes_up + (tier.bytes_in if tier else 0)
        started = time.thread_time()
        record = coordinator.run_round()
        total = time.thread_time() - started
        own = total - client.waiting + client.handlers.seconds
        rows.append(
            {
                "updates": float(record.participants),
                "coordinator_s": own,
                "status_s": status.seconds,
                "status_bytes": float(client.status_bytes),
                "status_messages": float(client.status_messages),
                "aggregator_s": max((c.seconds for c in clocks), default=0.0),
                "aggregators_s": sum(clock.seconds for clock in clocks),
                "inbound": float(
                    coordinator.traffic.bytes_up + (tier.bytes_in if tier else 0) - inbound
                ),
                "held": float(held[-1]),
            }
        )
    result = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result.update(rss_built=built, rss_registered=registered, rss_peak=_peak_rss(registered))
    return result


def _peak_rss(floor: float) -> float:
    """The process's peak resident set (VmHWM; at least `floor` where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return floor


def measure_apart(devices: int, participation: float, groups: int, rounds: int) -> dict[str, float]:
    """`measure` in a fresh process: its memory is this configuration's alone."""
    one = f"{devices},{participation},{groups}"
    command = [sys.executable, "-m", "benchmarks.aggregator_tier", "--one", one]
    done = subprocess.run(
        [*command, "--rounds", str(rounds)], check=True, capture_output=True, text=True
    )
    return cast(dict[str, float], json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    """Measure every configuration of RUNS, each in a fresh process; publish table and plot."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    parser.add_argument("--quick", action="store_true", help="two small configurations only")
    parser.add_argument("--save", type=Path, default=None, help="also write the raw runs (JSON)")
    parser.add_argument("--load", type=Path, default=None, help="report saved runs, no measuring")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    one_thread()
    if args.one is not None:  # the child of `measure_apart`
        devices, participation, groups = args.one.split(",")
        result = measure(int(devices), float(participation), int(groups), args.rounds)
        print(json.dumps(result), flush=True)
        return
    runs = [] if args.load is None else report.load(args.load)
    for devices, participation, groups in () if runs else QUICK if args.quick else RUNS:
        result = measure_apart(devices, participation, groups, args.rounds)
        runs.append(Run(devices, participation, groups, result))
        print(report.row(runs[-1]), flush=True)
        if args.save is not None:
            report.save(runs, args.save)
    params = sum(t.numel() for t in load_task(TASK).build_model(0).state_dict().values())
    if args.plot is not None:
        report.plot(runs, args.plot)
    lines = report.section(runs, args.rounds, params, args.plot)
    if args.out is not None:
        publish_section(args.out, MARKER, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
