"""A soak with chaos: agent processes behind shaped links, and faults while rounds go on.

One driver for the short soak in the suite and the long one in `benchmarks/soak.py`. A serving
coordinator (a child process) is killed with SIGKILL once a round is checkpointed and resumed
in-process; from then on, each time a round closes, one fault is injected before the next one
is announced: an agent killed (SIGKILL) and restarted on its state directory, the broker
restarted with nothing kept, one device's link partitioned (black-holed once the device tried to
come back, healed a few seconds later), or
every link cut at once (the next round waits until all reconnected). Every single agent talks to the
broker through its own fault proxy shaped as one of the link profiles; a large fleet adds
`pfl-agent pool` processes, each pool's devices behind one proxy (every connection through it
shaped as the pool's link). Pools keep personal state in memory, so the agent kills hit the
single agents, which keep theirs in a state directory; partitions, resets and broker restarts
hit pools too.

Faults land where a round closes, so that the fault-free run is the reference: the checks are
that every round 1..R is recorded exactly once, every round had every device exactly once,
and the final model and the devices' personalized metrics are bit for bit those of the
in-process simulation of the same fleet (an update counted twice, a lost round or a lost
personal state would each change them).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from coordinator.engine.rounds import RoundRecord
from coordinator.run.pipeline import RunResult
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation
from device_agent.agent import DeviceAgent
from device_agent.state_store import RECORD_FILE, DiskStateStore
from device_agent.virtual_fleet import device_name
from protocols import topics
from protocols.codec import Tensors, decode_frame, pack_tensors
from protocols.messages import DeviceStatus, EvaluationReport
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes, wait_for
from tests.netlab.profiles import Link
from tests.netlab.proxy import FaultProxy

logger = logging.getLogger(__name__)
Fault = Literal["agent-restart", "broker-restart", "partition", "link-reset"]
FAULTS: Final[tuple[Fault, ...]] = ("agent-restart", "broker-restart", "partition", "link-reset")
HEAL_AFTER_S: Final = 3.0
CEILING_S: Final = 240.0


@dataclass(frozen=True)
class SoakPlan:
    """What to run and how hard to shake it."""

    devices: int
    rounds: int
    links: tuple[Link, ...]
    """Device i's link is links[i % len(links)]."""
    task: str = "digits"
    algorithm: str = "ditto"
    chaos_seed: int = 0
    """Which devices the faults hit (and which fault, once each kind was injected once)."""
    kill_coordinator_at: int = 1
    """The checkpointed round after which the coordinator is killed and resumed."""
    ceiling_s: float = CEILING_S
    """The longest wait for any one thing (the fleet's start, an agent back, a checkpoint)."""
    pools: int = 0
    """`pfl-agent pool` processes, each holding `pool_devices` of the fleet's last devices."""
    pool_devices: int = 0
    pool_links: tuple[Link, ...] = ()
    """Pool j's link is pool_links[j % len(pool_links)] (empty: `links`). A pool connects its
    devices one after another, each a few round trips: over the NB-IoT-like link about 18 s a
    device, a quarter of an hour for a pool of 48."""

    def __post_init__(self) -> None:
        if self.singles < 1:
            msg = f"{self.devices} devices leave no single agent beside {self.pools} pools"
            raise ValueError(msg)

    @property
    def singles(self) -> int:
        """Devices 0..singles-1 are single agent processes; the rest live in pools."""
        return self.devices - self.pools * self.pool_devices

    def pool_range(self, pool: int) -> range:
        """The device indices of pool `pool`."""
        first = self.singles + pool * self.pool_devices
        return range(first, first + self.pool_devices)

    def link(self, proxy: int) -> Link:
        """The link of proxy `proxy`: single agent i's is i, pool j's is singles + j."""
        if proxy < self.singles:
            return self.links[proxy % len(self.links)]
        links = self.pool_links or self.links
        return links[(proxy - self.singles) % len(links)]

    def run_options(self) -> dict[str, Any]:
        """The settings the served run and its fault-free reference share."""
        return {"task": self.task, "algorithm": self.algorithm, "seed": 0}


@dataclass
class SoakReport:
    """What the soak did and what came of it."""

    plan: SoakPlan
    faults: list[tuple[int, Fault, str]] = field(default_factory=list)
    """(round after which it was injected, fault, device or "")."""
    killed_coordinator_at: int = 0
    result: RunResult | None = None
    wall_seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    load: list[float] = field(default_factory=list)
    """The 1-minute load average as each round closed."""
    state_root: Path | None = None
    """Where the single agents kept their personal state (a directory each)."""

    def counts(self) -> dict[str, int]:
        """How many faults of each kind were injected (the coordinator kill included)."""
        kinds: dict[str, int] = {kind: 0 for kind in FAULTS}
        for _, kind, _ in self.faults:
            kinds[kind] += 1
        return {"coordinator-kill": 1 if self.killed_coordinator_at else 0, **kinds}


class StatusWatch:
    """Every device status the broker relays, to wait for an agent restarted to come back."""

    def __init__(self, url: str, ceiling_s: float) -> None:
        self.ceiling_s = ceiling_s
        self.statuses: list[DeviceStatus] = []
        self._transport = MqttTransport(
            BrokerSettings(url=url, reconnect_min_delay_s=0.1, reconnect_max_delay_s=1.0),
            "soak-status-watch",
            clean_start=True,
        )
        self._transport.subscribe(topics.device_subscription("default", "status"), self._take)

    def _take(self, _topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if isinstance(message, DeviceStatus):
            self.statuses.append(message)

    def mark(self) -> int:
        """A point in the stream to wait from."""
        return len(self.statuses)

    def wait_back(self, device_id: str, since: int) -> bool:
        """Wait until `device_id` went offline and then online again after `since`."""

        def back() -> bool:
            states = [s.state for s in self.statuses[since:] if s.device_id == device_id]
            return "offline" in states and "online" in states[states.index("offline") :]

        return self._transport.wait_until(back, self.ceiling_s)

    def close(self) -> None:
        """Disconnect."""
        self._transport.close()


class Soak:
    """Agents behind proxies, a coordinator killed and resumed, faults between rounds."""

    def __init__(
        self, plan: SoakPlan, broker: Mosquitto, processes: Processes, directory: Path
    ) -> None:
        self.plan = plan
        self.broker = broker
        self.processes = processes
        self.directory = directory
        self.report = SoakReport(plan)
        self._random = random.Random(plan.chaos_seed)
        self._proxies: list[FaultProxy] = []
        self._timers: list[threading.Timer] = []

    def run(self) -> SoakReport:
        """Run the whole soak; the caller checks `report.result` against the fault-free run."""
        started = time.monotonic()
        plan = self.plan
        for index in range(plan.singles + plan.pools):
            proxy = FaultProxy(self.broker.port, plan.link(index), seed=plan.chaos_seed + index)
            self._proxies.append(proxy.start())
            if index < plan.singles:
                self._start_agent(index)
            else:
                self._start_pool(index - plan.singles)
        watch = StatusWatch(self.broker.url, plan.ceiling_s)
        try:
            self.report.killed_coordinator_at = self._kill_coordinator()
            self.report.result = run_serve(self._settings(resume=True), on_round=self._chaos(watch))
        finally:
            for timer in self._timers:
                timer.join(timeout=self.plan.ceiling_s)
            watch.close()
            for proxy in self._proxies:
                self.report.bytes_up += proxy.bytes_up
                self.report.bytes_down += proxy.bytes_down
                proxy.stop()
        self.report.wall_seconds = time.monotonic() - started
        self.report.state_root = self.processes.directory / "state"
        return self.report

    @property
    def ceiling(self) -> float:
        """The longest wait for any one thing."""
        return self.plan.ceiling_s

    def _kill_coordinator(self) -> int:
        """Serve as a child process; SIGKILL it once its checkpoint has the planned round."""
        command = [
            sys.executable, "-m", "coordinator.cli.app", "serve", *self._flags(),
            "--out", str(self.directory / "run"),
            "--checkpoint-dir", str(self.directory / "checkpoint"),
        ]  # fmt: skip
        coordinator = self.processes.start("coordinator", command)
        checkpoint = self.directory / "checkpoint" / "checkpoint.json"
        deadline = time.monotonic() + self.plan.ceiling_s
        while time.monotonic() < deadline and coordinator.poll() is None:
            if _checkpointed(checkpoint) >= self.plan.kill_coordinator_at:
                break
            time.sleep(0.05)
        coordinator.kill()
        coordinator.wait(timeout=self.plan.ceiling_s)
        if not checkpoint.exists():
            msg = f"no checkpoint within {self.plan.ceiling_s} s; see {self.directory}"
            raise RuntimeError(msg)
        return _checkpointed(checkpoint)

    def _start_agent(self, index: int) -> None:
        self.processes.agent(
            self._proxies[index].url,
            index,
            shards=self.plan.devices,
            task=self.plan.task,
        )

    def _start_pool(self, pool: int) -> None:
        devices = self.plan.pool_range(pool)
        command = [
            sys.executable, "-m", "device_agent.cli", "pool",
            "--broker", self._proxies[self.plan.singles + pool].url,
            "--devices", f"{devices[0]}-{devices[-1]}", "--num-shards", str(self.plan.devices),
            "--task", self.plan.task,
        ]  # fmt: skip
        self.processes.start(f"pool-{pool}", command)

    def _flags(self) -> list[str]:
        plan = self.plan
        return [
            "--broker", self.broker.url, "--task", plan.task, "--algorithm", plan.algorithm,
            "--seed", "0", "--rounds", str(plan.rounds),
            "--min-devices", str(plan.devices), "--round-timeout", "300",
        ]  # fmt: skip

    def _settings(self, *, resume: bool) -> ServeSettings:
        return ServeSettings.load(
            None,
            **self.plan.run_options(),
            broker=self.broker.url,
            rounds=self.plan.rounds,
            min_devices=self.plan.devices,
            round_timeout=300.0,
            join_timeout=self.plan.ceiling_s,
            out=self.directory / "run",
            checkpoint_dir=self.directory / "checkpoint",
            resume=resume,
        )

    def _chaos(self, watch: StatusWatch) -> Callable[[RoundRecord], None]:
        def on_round(record: RoundRecord) -> None:
            self.report.load.append(os.getloadavg()[0])
            if record.round_id >= self.plan.rounds:
                return
            done = len(self.report.faults)
            kind = FAULTS[done] if done < len(FAULTS) else self._random.choice(FAULTS)
            hit = self._inject(kind, watch)
            self.report.faults.append((record.round_id, kind, hit))
            logger.info(
                "round %d: %d devices; then %s %s", record.round_id, record.participants, kind, hit
            )

        return on_round

    def _inject(self, kind: Fault, watch: StatusWatch) -> str:
        """Inject one fault; return the device or pool it hit ("" for all)."""
        plan = self.plan
        index = self._random.randrange(
            plan.singles if kind == "agent-restart" else len(self._proxies)
        )
        device = device_name(index) if index < plan.singles else f"pool-{index - plan.singles}"
        if kind == "agent-restart":
            since = watch.mark()
            victim = self.processes.running[device]
            victim.kill()
            victim.wait(timeout=self.plan.ceiling_s)
            self._start_agent(index)
            if not watch.wait_back(device, since):
                msg = f"{device} did not come back after its restart"
                raise RuntimeError(msg)
            return device
        if kind == "broker-restart":
            self.broker.restart(down_s=0.5)
            return ""
        if kind == "partition":
            proxy = self._proxies[index]
            tried = proxy.connections_refused
            proxy.partition("blackhole")
            # once the device tried to come back, its last-will has long reached the coordinator
            wait_for(lambda: proxy.connections_refused > tried, f"{device} retrying", self.ceiling)
            timer = threading.Timer(HEAL_AFTER_S, proxy.heal)
            timer.start()
            self._timers.append(timer)
            return device
        accepted = [proxy.connections_accepted for proxy in self._proxies]
        for proxy in self._proxies:
            proxy.reset()
        for proxy, before in zip(self._proxies, accepted, strict=True):
            wait_for(_accepted_more(proxy, before), "every device reconnected", self.ceiling)
        return ""


def fault_free(plan: SoakPlan) -> SimulationResult:
    """The in-process simulation of the soak's fleet, with its agents kept for inspection."""
    return run_simulation(
        SimulationSettings.load(
            None,
            **plan.run_options(),
            devices=plan.devices,
            rounds=plan.rounds,
            batched="off",
            workers=1,
        )
    )


def evaluations(reports: Sequence[EvaluationReport]) -> dict[str, tuple[float, float | None]]:
    """Each device's own last evaluation: its personalized and the global model's metric."""
    return {r.device_id: (r.personalized, r.global_model) for r in reports}


def personal_fingerprints(
    state_root: Path, reference: Sequence[DeviceAgent]
) -> dict[str, tuple[str, str]]:
    """Per agent process: the sha256 of its personal state on disk and of the reference's.

    `state_root` holds a state directory per single agent (`Processes.agent`); `reference` are
    the fault-free simulation's agents (run in-process). The devices in pools are not here:
    their state lives in the pool's memory and ends with it.
    """
    held = {agent.device_id: agent.store for agent in reference}
    prints = {}
    for directory in sorted(state_root.iterdir()):
        split = json.loads((directory / RECORD_FILE).read_text())["fingerprint"]
        on_disk = DiskStateStore(directory).load(split) or {}
        expected = held[directory.name].load(split) or {}
        prints[directory.name] = (_digest(on_disk), _digest(expected))
    return prints


def _digest(tensors: Tensors) -> str:
    return pack_tensors(tensors)[0].sha256


def _checkpointed(checkpoint: Path) -> int:
    """The round a checkpoint holds (0: none yet; each file is written atomically)."""
    if not checkpoint.exists():
        return 0
    return int(json.loads(checkpoint.read_text())["round_id"])


def _accepted_more(proxy: FaultProxy, before: int) -> Callable[[], bool]:
    return lambda: proxy.connections_accepted > before
