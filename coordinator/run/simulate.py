"""Simulation: the real coordinator and N real device agents on one machine.

Every message is encoded exactly as on the wire and counted, over the in-process hub (or MQTT).
Virtual devices share one model object per process and keep only their own personal state, so
thousands fit in memory. They run in this process or in one worker process per core
(`workers`); handlers run one at a time per process and the coordinator aggregates in device
order, so a run's results depend on its seed alone, not on the number of workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from coordinator.dashboard.history import RunHistoryLog, publish_round
from coordinator.engine.metrics import RunRecorder
from coordinator.engine.rounds import Coordinator, RoundRecord, coordinator_will
from coordinator.run.pipeline import (
    RoundCallback,
    RunResult,
    build_coordinator,
    drive_rounds,
    plan_stages,
    summarize_run,
)
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulation_workers import WorkerDevices, threads_per_worker, worker_count
from coordinator.scheduling.asynchronous import BufferedRounds
from coordinator.scheduling.availability import SimulatedClock
from coordinator.stages.privacy import privacy_engine
from coordinator.tier.local import local_aggregators
from device_agent.agent import DeviceAgent
from device_agent.attacks import AttackPlan
from device_agent.batched.choice import choose_trainer
from device_agent.compute_threads import torch_threads
from device_agent.exporting import export_fleet
from device_agent.virtual_fleet import VirtualFleet, device_name
from pfl_tasks.registry import load_task
from protocols.access import COORDINATOR_USER
from protocols.errors import RoundError
from protocols.messages import EvaluationReport
from protocols.transport.base import Transport, Will
from protocols.transport.factory import connect
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.process_hub import ProcessHub
from protocols.transport.run_access import DEVICE_USER, RunAccess, coordinator_client_id
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)
__all__ = ["DeviceHost", "SimulationResult", "device_name", "run_simulation"]


class DeviceHost(Protocol):
    """Where a simulation's virtual devices run: this process, or worker processes."""

    agents: list[DeviceAgent]
    """The agents, when they live in this process (for inspection); empty otherwise."""

    def settle(self) -> tuple[int, int]:
        """Let messages in flight arrive; payload bytes all devices sent and received."""
        ...

    def export(self, directory: Path, *, quantize: str | None, guard: bool) -> dict[str, Any]:
        """Every device's personalized model, exported and verified: the summary's entry."""
        ...


@dataclass
class SimulationResult(RunResult):
    """A simulated run's result, and its virtual devices (for byte counts and inspection).

    `agents` is empty when the devices ran in worker processes.
    """

    agents: list[DeviceAgent] = field(default_factory=list)

    def device_bytes(self) -> tuple[int, int]:
        """Payload bytes all devices sent and received, as their transports counted them."""
        return _device_bytes(self.agents)


def _device_bytes(agents: list[DeviceAgent]) -> tuple[int, int]:
    sent = sum(agent.transport.stats.bytes_sent for agent in agents)
    received = sum(agent.transport.stats.bytes_received for agent in agents)
    return sent, received


class LocalDevices:
    """Virtual devices in this process: on the hub, or MQTT clients with a thread each."""

    def __init__(self, agents: list[DeviceAgent], hub: InProcessBroker | None) -> None:
        self.agents = agents
        self._hub = hub

    def settle(self) -> tuple[int, int]:
        """See `DeviceHost.settle`."""
        if self._hub is not None:
            self._hub.pump(lambda: False)
        return _device_bytes(self.agents)

    def export(self, directory: Path, *, quantize: str | None, guard: bool) -> dict[str, Any]:
        """See `DeviceHost.export`."""
        sources = [agent.exports.source() for agent in self.agents]
        return export_fleet(sources, directory, quantize=quantize, guard=guard)


@dataclass(frozen=True)
class _Wiring:
    connect_coordinator: Callable[[], Transport]
    host: Callable[[VirtualFleet, int], DeviceHost]
    """Starts the devices of a fleet whose training steps take that many multiply-adds."""
    connect_service: Callable[[str], Transport] | None = None
    """A client of the hub for a service beside the coordinator (the tier's aggregators)."""


def join_timeout(devices: int) -> float:
    """Seconds a simulation waits for its devices' hellos (10,000 take a while to start)."""
    return max(60.0, 0.05 * devices)


def run_simulation(
    settings: SimulationSettings,
    on_round: RoundCallback | None = None,
    broker: InProcessBroker | None = None,
) -> SimulationResult:
    """Run a whole federated training and evaluation with virtual devices.

    Byte counts in the summary and the round records are measured at the devices' transports,
    each once the messages of its round have all arrived. A caller may pass its own `broker`,
    e.g. with a wiretap subscribed to `#` (a `ProcessHub` when the devices run in workers).

    Raises:
        ValueError: an unknown task, algorithm or option.
        RoundError: a round could not close (e.g. every device failed), or a worker died.
    """
    with ExitStack() as cleanup:
        return _run(settings, _wiring(settings, broker, cleanup), on_round)


def _wiring(
    settings: SimulationSettings, broker: InProcessBroker | None, cleanup: ExitStack
) -> _Wiring:
    """How the coordinator and the virtual devices reach each other, and where devices run."""
    every = range(settings.devices)
    if settings.transport == "mqtt":
        return _mqtt_wiring(settings, cleanup)
    workers = worker_count(settings.workers, settings.devices)
    if workers == 1:
        hub = broker or InProcessBroker()

        def host_here(fleet: VirtualFleet, step_macs: int) -> DeviceHost:
            cleanup.enter_context(torch_threads(threads_per_worker(1, step_macs)))
            trainer = choose_trainer(settings.batched, step_macs)
            if trainer is not None:  # trains what the devices were handed once the hub is idle
                hub.idle.append(trainer.flush)
            agents = fleet.build(
                every,
                lambda device, will: connect(hub, device, will),
                threaded=False,
                trainer=trainer,
            )
            return LocalDevices(agents, hub)

        will = coordinator_will(settings.fleet)
        return _Wiring(
            lambda: connect(hub, "coordinator", will), host_here, lambda name: connect(hub, name)
        )
    if broker is not None and not isinstance(broker, ProcessHub):
        msg = "a caller's InProcessBroker serves devices in this process only: pass a ProcessHub"
        raise ValueError(msg)
    process_hub = broker or ProcessHub()

    def host_in_workers(fleet: VirtualFleet, step_macs: int) -> DeviceHost:
        threads = threads_per_worker(workers, step_macs)
        batched = choose_trainer(settings.batched, step_macs) is not None
        devices = WorkerDevices(process_hub, fleet, settings.devices, workers, threads, batched)
        cleanup.callback(devices.close)
        return devices

    return _Wiring(
        lambda: connect(process_hub, "coordinator", coordinator_will(settings.fleet)),
        host_in_workers,
        lambda name: connect(process_hub, name),
    )


def _mqtt_wiring(settings: SimulationSettings, cleanup: ExitStack) -> _Wiring:
    """Every virtual device a real MQTT client of its own, in this process."""
    if settings.workers > 1:
        msg = (
            "--workers runs devices on the in-process hub; over MQTT, spread them over "
            "processes or machines with `pfl-agent pool`"
        )
        raise ValueError(msg)
    if settings.batched == "on":
        msg = "--batched on trains devices together on the in-process hub; over MQTT use off/auto"
        raise ValueError(msg)
    url = settings.broker
    accounts: RunAccess | None = None
    if url is None:  # this run's accounts, handed to its in-process clients only
        from protocols.transport.broker import EmbeddedBroker  # amqtt: only this run needs it

        accounts = RunAccess.generate(settings.fleet)
        embedded = cleanup.enter_context(EmbeddedBroker(run_access=accounts))
        url = embedded.url
        logger.warning("no --broker given: serving an embedded MQTT broker on %s", url)
    broker_settings = BrokerSettings(url=url)

    def connect_as(client_id: str, will: Will, account: str = DEVICE_USER) -> Transport:
        as_account = broker_settings
        if accounts is not None:
            as_account = accounts.settings(account, broker_settings)
        transport = connect(as_account, client_id, will, clean_start=True)
        cleanup.callback(transport.close)
        return transport

    def host(fleet: VirtualFleet, step_macs: int) -> DeviceHost:
        cleanup.enter_context(torch_threads(threads_per_worker(1, step_macs)))
        return LocalDevices(fleet.build(range(settings.devices), connect_as, threaded=True), None)

    coordinator_id = coordinator_client_id(settings.fleet)
    will = coordinator_will(settings.fleet)
    return _Wiring(lambda: connect_as(coordinator_id, will, COORDINATOR_USER), host)


def buffered_rounds(
    coordinator: Coordinator, settings: SimulationSettings, clock: SimulatedClock
) -> BufferedRounds:
    """Asynchronous rounds, or synchronous ones, on the simulated clock.

    What the clock does not combine with is refused before, by `plan_stages`'s check.
    """
    return BufferedRounds(coordinator, settings.async_settings(), clock, settings.participation)


def attack_plan(settings: SimulationSettings) -> AttackPlan | None:
    """The malicious virtual devices `--attack` and `--malicious-fraction` ask for (or None).

    Raises:
        ValueError: an attack without a fraction, or a fraction without an attack.
    """
    if settings.attack == "none":
        if settings.malicious_fraction > 0:
            msg = "--malicious-fraction needs an --attack"
            raise ValueError(msg)
        return None
    if settings.malicious_fraction == 0:
        msg = f"--attack {settings.attack} needs a --malicious-fraction above 0"
        raise ValueError(msg)
    plan = AttackPlan.draw(
        settings.attack,
        settings.malicious_fraction,
        settings.devices,
        settings.seed,
        settings.attack_strength,
    )
    logger.warning(
        "simulating %d malicious devices (%s, strength %.3g): %s",
        len(plan.malicious),
        plan.name,
        plan.strength,
        ", ".join(device_name(i) for i in sorted(plan.malicious)),
    )
    return plan


def _run(
    settings: SimulationSettings, wiring: _Wiring, on_round: RoundCallback | None
) -> SimulationResult:
    started = time.perf_counter()
    task = load_task(settings.task, settings.task_options)
    workspace = task.build_model(settings.seed)
    stages = plan_stages(settings, task, workspace)  # refuses what does not compose
    engine = settings.engine_settings(task, stages.total_rounds)
    coordinator = build_coordinator(
        wiring.connect_coordinator,
        stages,
        workspace,
        engine,
        task,
        privacy_engine(settings.privacy(), settings.participation, settings.seed),
    )
    local_aggregators(settings.tier.names(), settings.fleet, wiring.connect_service)
    attack = attack_plan(settings)
    fleet = VirtualFleet.create(
        fleet=settings.fleet,
        task=task,
        devices=settings.devices,
        partition=settings.partition_spec(),
        seed=settings.seed,
        stateful=not settings.stateless,
        attack=attack,
    )
    devices = wiring.host(fleet, fleet.step_macs(stages.final.config.batch_size))
    fastest = frozenset(
        device_name(i)
        for i in (attack.malicious if attack and settings.attack_speed == "fastest" else ())
    )
    clock = settings.simulated_clock([device_name(i) for i in range(settings.devices)], fastest)
    buffered = None if clock is None else buffered_rounds(coordinator, settings, clock)
    coordinator.start()
    if not coordinator.wait_for_devices(settings.devices, timeout_s=join_timeout(settings.devices)):
        msg = f"only {coordinator.registry.online_count()} of {settings.devices} devices joined"
        raise RoundError(msg)

    run_settings = settings.model_dump(mode="json")
    recorder = RunRecorder(settings.out, run_settings)
    # over MQTT a dashboard may attach through the broker: keep the run's history there too
    history = RunHistoryLog(settings.fleet, run_settings) if settings.transport == "mqtt" else None
    moved = [devices.settle()]

    def after_round(record: RoundRecord, evaluated: Sequence[EvaluationReport]) -> None:
        (sent_before, received_before), (sent, received) = moved[-1], devices.settle()
        record.bytes_up, record.bytes_down = sent - sent_before, received - received_before
        moved.append((sent, received))
        line = record.line()
        recorder.record_round(line, evaluated, coordinator.last_fleet_status)
        if history is not None:
            publish_round(coordinator, history, line, evaluated)
        if on_round is not None:
            on_round(record)

    def run_round() -> RoundRecord:
        # Every virtual device is meant to take part: after a lost connection (a restarted
        # broker), wait for them all to say hello again rather than train without some.
        if not coordinator.wait_for_devices(settings.devices, join_timeout(settings.devices)):
            logger.warning(
                "round %d: only %d of %d devices are back online; training without the rest",
                coordinator.round_id + 1,
                coordinator.registry.online_count(),
                settings.devices,
            )
        return coordinator.run_round() if buffered is None else buffered.run_round()

    records, reports = drive_rounds(
        coordinator, stages, run_round=run_round, after_round=after_round, scheduler=buffered
    )
    final_shared = coordinator.shared
    summary = replace(
        summarize_run(
            coordinator,
            stages,
            settings,
            records,
            reports,
            devices=settings.devices,
            traffic=devices.settle(),
            started=started,
        ),
        stateless=settings.stateless,
        partition=settings.partition,
        alpha=settings.alpha,
        sim_seconds=None if clock is None else clock.now,
    )
    if settings.export_dir is not None:  # every device's personalized model, verified
        exported = devices.export(
            settings.export_dir, quantize=settings.export_quantize, guard=settings.export_guard
        )
        summary = replace(summary, export=exported)
    recorder.write_devices(reports)
    recorder.write_summary(summary)
    return SimulationResult(summary, records, reports, final_shared, devices.agents)
