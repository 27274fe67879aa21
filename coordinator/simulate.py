"""Simulation: the real coordinator and N real device agents on one machine.

Every message is encoded exactly as on the wire and counted, over the in-process hub (or MQTT).
Virtual devices share one model object and keep only their own personal state, so a thousand of
them fit in memory; handlers run one at a time, so a run is deterministic for its seed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from coordinator.metrics import RunRecorder
from coordinator.pipeline import (
    RoundCallback,
    RunResult,
    build_coordinator,
    drive_rounds,
    plan_stages,
    summarize_run,
)
from coordinator.rounds import EngineSettings, RoundRecord, coordinator_will
from coordinator.settings import SimulationSettings
from device_agent.agent import DeviceAgent, device_will
from device_agent.capabilities import probe_capabilities
from device_agent.exporting import export_fleet
from device_agent.received import DecodedModelCache
from device_agent.state_store import MemoryStateStore
from pfl_tasks.registry import load_task
from protocols.errors import RoundError
from protocols.transport.base import Transport, Will
from protocols.transport.broker import EmbeddedBroker
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)
Connect = Callable[[str, Will], Transport]


@dataclass
class SimulationResult(RunResult):
    """A simulated run's result, and its virtual devices (for byte counts and inspection)."""

    agents: list[DeviceAgent] = field(default_factory=list)

    def device_bytes(self) -> tuple[int, int]:
        """Payload bytes all devices sent and received, as their transports counted them."""
        return _device_bytes(self.agents)


def _device_bytes(agents: list[DeviceAgent]) -> tuple[int, int]:
    sent = sum(agent.transport.stats.bytes_sent for agent in agents)
    received = sum(agent.transport.stats.bytes_received for agent in agents)
    return sent, received


def device_name(index: int) -> str:
    """The id of virtual device `index`."""
    return f"dev-{index:04d}"


def run_simulation(
    settings: SimulationSettings,
    on_round: RoundCallback | None = None,
    broker: InProcessBroker | None = None,
) -> SimulationResult:
    """Run a whole federated training and evaluation with virtual devices.

    Byte counts in the summary and the round records are measured at the devices' transports.
    A caller may pass its own `broker`, e.g. with a wiretap subscribed to `#`.

    Raises:
        ValueError: an unknown task, algorithm or option.
        RoundError: a round could not close (e.g. every device failed).
    """
    with ExitStack() as cleanup:
        connect = _transports(settings, broker, cleanup)
        return _run(settings, connect, on_round)


def _transports(
    settings: SimulationSettings, broker: InProcessBroker | None, cleanup: ExitStack
) -> Connect:
    """How virtual devices reach the coordinator: the in-process hub or real MQTT clients."""
    if settings.transport == "inprocess":
        hub = broker or InProcessBroker()
        return lambda client_id, will: hub.connect(client_id, will)
    url = settings.broker
    if url is None:
        embedded = cleanup.enter_context(EmbeddedBroker())
        url = embedded.url
        logger.warning("no --broker given: serving an embedded MQTT broker on %s", url)
    broker_settings = BrokerSettings(url=url)

    def connect(client_id: str, will: Will) -> Transport:
        transport = MqttTransport(broker_settings, client_id, will=will, clean_start=True)
        cleanup.callback(transport.close)
        return transport

    return connect


def _run(
    settings: SimulationSettings, connect: Connect, on_round: RoundCallback | None
) -> SimulationResult:
    started = time.perf_counter()
    task = load_task(settings.task, settings.task_options)
    fleet_data = task.make_fleet(settings.devices, settings.partition_spec(), settings.seed)
    workspace = task.build_model(settings.seed)
    initial_state = {name: value.detach().clone() for name, value in workspace.state_dict().items()}
    stages = plan_stages(settings, task, workspace)
    if settings.stateless and stages.final.config.stateful_only:
        msg = (
            f"{stages.final.config.name} keeps per-device state between rounds: "
            "run it without --stateless"
        )
        raise ValueError(msg)
    engine = EngineSettings(
        fleet=settings.fleet,
        task=task.name,
        rounds=stages.total_rounds,
        eval_every=settings.eval_every,
        seed=settings.seed,
        guard=settings.guard_settings(),
        uplink=settings.uplink(),
        downlink=settings.compress_down,
    )
    coordinator = build_coordinator(
        lambda: connect("coordinator", coordinator_will(settings.fleet)),
        stages,
        workspace,
        engine,
        task,
    )
    # Over MQTT every device handles messages on its own thread: each needs its own workspace.
    threaded = settings.transport != "inprocess"
    agents: list[DeviceAgent] = []
    capabilities = probe_capabilities()
    model_cache = DecodedModelCache()
    for index, data in enumerate(fleet_data):
        device_id = device_name(index)
        agent = DeviceAgent(
            device_id=device_id,
            fleet=settings.fleet,
            transport=connect(device_id, device_will(settings.fleet, device_id)),
            task=task,
            data=data,
            seed=settings.seed,
            store=MemoryStateStore(),
            workspace=task.build_model(settings.seed) if threaded else workspace,
            initial_state=initial_state,
            stateful=not settings.stateless,
            capabilities=capabilities,
            model_cache=DecodedModelCache() if threaded else model_cache,
        )
        agent.start()
        agents.append(agent)
    coordinator.start()
    if not coordinator.wait_for_devices(settings.devices, timeout_s=60.0):
        msg = f"only {coordinator.registry.online_count()} of {settings.devices} devices joined"
        raise RoundError(msg)

    recorder = RunRecorder(settings.out)
    moved = [_device_bytes(agents)]

    def after_round(record: RoundRecord) -> None:
        (sent_before, received_before), (sent, received) = moved[-1], _device_bytes(agents)
        record.bytes_up, record.bytes_down = sent - sent_before, received - received_before
        moved.append((sent, received))
        recorder.record_round(record.as_json())
        if on_round is not None:
            on_round(record)

    records, reports = drive_rounds(
        coordinator,
        stages,
        eval_every=settings.eval_every,
        run_round=coordinator.run_round,
        after_round=after_round,
    )
    coordinator.publish_status("finished")
    final_shared = coordinator.shared
    summary = replace(
        summarize_run(
            coordinator,
            stages,
            settings,
            records,
            reports,
            metric_name=task.metric_name,
            devices=settings.devices,
            traffic=_device_bytes(agents),
            started=started,
        ),
        stateless=settings.stateless,
        partition=settings.partition,
        alpha=settings.alpha,
    )
    if settings.export_dir is not None:  # every device's personalized model, verified
        exported = export_fleet(
            [agent.export_source() for agent in agents],
            settings.export_dir,
            quantize=settings.export_quantize,
            guard=settings.export_guard,
        )
        summary = replace(summary, export=exported)
    recorder.write_devices(reports)
    recorder.write_summary(summary)
    return SimulationResult(summary, records, reports, final_shared, agents)
