"""Run one real device agent over MQTT until SIGTERM or SIGINT, then leave cleanly."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from device_agent.agent import DeviceAgent, device_will
from device_agent.capabilities import available_memory_bytes, require_numpy_bridge
from device_agent.compute_threads import StepThreads
from device_agent.coordinator_watch import CoordinatorWatch
from device_agent.eligibility import EligibilityPolicy
from device_agent.memory_plan import parse_memory_budget
from device_agent.settings import AgentSettings
from device_agent.state_store import DiskStateStore
from device_agent.work_limits import WorkLimits
from pfl_tasks.base import DeviceData, Task
from pfl_tasks.datadir import load_device_data
from pfl_tasks.fit_check import check_model_fits
from pfl_tasks.registry import load_task
from protocols.program_options import stop_on_signals
from protocols.start_line import start_line
from protocols.transport.base import Transport
from protocols.transport.factory import connect
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.mqtt import BrokerConnectionError

logger = logging.getLogger(__name__)


def load_data(settings: AgentSettings, task: Task) -> DeviceData:
    """This device's data: its own directory, or its shard of the task's data.

    Raises:
        ValueError: the directory or shard cannot be loaded, or its data does not fit the model,
            or torch cannot use the installed NumPy.
    """
    require_numpy_bridge()
    if settings.data is not None:
        data = load_device_data(settings.data, settings.data_shard or 0)
        check_model_fits(task, data.train, f"--data {settings.data}")
        return data
    fleet = task.make_fleet(settings.num_shards, settings.partition_spec(), settings.seed)
    return fleet[settings.data_shard or 0]


@dataclass(frozen=True)
class _Running:
    """What only an agent that takes part in rounds needs (the defaults: none of it)."""

    memory_budget_bytes: int | None = None
    eligibility: EligibilityPolicy | None = None
    limits: WorkLimits | None = None
    threads: StepThreads | None = None
    strict_egress: bool = False


def build_agent(settings: AgentSettings, *, offline: bool = False) -> DeviceAgent:
    """A connected agent with the model, data and state store its settings describe.

    `offline` (`pfl-agent export`) builds the same agent on a private in-process transport that
    reaches no broker, without what only taking part in rounds needs (memory budget,
    eligibility, work limits, compute threads, strict egress).

    Raises:
        ValueError: unknown task or unusable data.
        BrokerConnectionError: the broker cannot be reached.
    """
    task = load_task(settings.task, settings.task_options)
    data = load_data(settings, task)
    workspace = task.build_model(settings.seed)
    initial_state = {k: v.detach().clone() for k, v in workspace.state_dict().items()}
    transport: Transport
    if offline:
        transport = connect(InProcessBroker(), settings.device_id)
        running = _Running()
    else:
        transport = connect(
            settings.broker_settings(settings.broker).model_copy(
                update={"max_takeovers": settings.max_takeovers}
            ),
            settings.device_id,
            device_will(
                settings.fleet, settings.device_id, strict_egress=settings.dp_strict_egress
            ),
        )
        running = _running(settings, task, data)
    return DeviceAgent(
        device_id=settings.device_id,
        fleet=settings.fleet,
        transport=transport,
        task=task,
        data=data,
        seed=settings.seed,
        store=DiskStateStore(settings.state_dir),
        workspace=workspace,
        initial_state=initial_state,
        stateful=not settings.stateless,
        memory_budget_bytes=running.memory_budget_bytes,
        eligibility=running.eligibility,
        limits=running.limits,
        threads=running.threads,
        strict_egress=running.strict_egress,
    )


def _running(settings: AgentSettings, task: Task, data: DeviceData) -> _Running:
    return _Running(
        memory_budget_bytes=None
        if settings.memory_budget is None
        else parse_memory_budget(settings.memory_budget, available_memory_bytes()),
        eligibility=EligibilityPolicy(
            min_free_memory_bytes=None
            if settings.min_free_memory is None
            else parse_memory_budget(settings.min_free_memory, available_memory_bytes()),
            max_load_per_core=settings.max_load_per_core,
            require_mains_power=settings.require_mains_power,
        ),
        limits=settings.work_limits(),
        threads=StepThreads(
            task.build_model(settings.seed), [data.train.inputs], settings.thread_ceiling()
        ),
        strict_egress=settings.dp_strict_egress,
    )


class DuplicateIdError(BrokerConnectionError):
    """Another client keeps taking this device's id on the broker; the agent gave up."""


def run_agent(settings: AgentSettings, stop: threading.Event | None = None) -> None:
    """Serve rounds until `stop` is set (by SIGTERM/SIGINT when called on the main thread).

    On the way out the work in flight finishes, the status turns "offline" and the connection
    closes cleanly; personal state is only ever replaced atomically, so no stop corrupts it.

    Raises:
        DuplicateIdError: another client kept taking this device's id (`max_takeovers` times).
    """
    stop = stop_on_signals(stop or threading.Event())
    agent = build_agent(settings)
    agent.start()
    watch = CoordinatorWatch(f"device {settings.device_id}", settings.fleet, settings.broker)
    watch.listen(agent.transport)
    logger.info(
        "%s",
        start_line(
            f"device {settings.device_id}", settings.broker, settings.fleet, settings.username
        ),
    )
    transport = agent.transport
    displaced = None
    try:
        with watch.quiet_normal_end():
            while not stop.wait(0.5):
                watch.check()
                displaced = transport.displaced
                if displaced is not None:
                    break
    finally:
        if displaced is None:
            agent.stop()
            logger.info("device %s stopped", settings.device_id)
    if displaced is not None:
        raise DuplicateIdError(displaced, device_id=settings.device_id)
