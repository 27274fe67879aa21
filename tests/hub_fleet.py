"""A coordinator and real device agents on one in-process hub: the quickest whole fleet."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from coordinator.stages.privacy import PrivacyEngine, privacy_engine
from device_agent.agent import DeviceAgent, device_will
from device_agent.capabilities import probe_capabilities
from device_agent.state_store import MemoryStateStore
from pfl_tasks.base import DeviceData, PartitionSpec, Task
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import DeviceHello, DeviceUpdate, RoundAnnouncement
from protocols.transport.base import Transport
from protocols.transport.inprocess import InProcessBroker

TASK = "digits"


def hub_coordinator(
    broker: InProcessBroker,
    algorithm: str,
    devices: int,
    rounds: int,
    *,
    run: dict[str, Any] | None = None,
    **options: Any,
) -> Coordinator:
    """A coordinator of `algorithm` on digits; `run` overrides settings, `options` the config.

    DP and secure aggregation in `run` take effect as in `simulate`.
    """
    settings = SimulationSettings.load(
        None,
        task=TASK,
        algorithm=algorithm,
        devices=devices,
        rounds=rounds,
        algorithm_options=options,
        **(run or {}),
    )
    task = load_task(TASK)
    model = task.build_model(0)
    return build_coordinator(
        lambda: broker.connect("coordinator"),
        plan_stages(settings, task, model),
        model,
        EngineSettings(
            task=TASK,
            rounds=rounds,
            quorum=0.5,
            uplink=settings.uplink(),
            downlink=settings.compress.down,
        ),
        privacy=privacy_engine(settings.privacy(), settings.participation, settings.seed),
    )


def hub_engine(
    broker: InProcessBroker,
    settings: SimulationSettings,
    engine: EngineSettings,
    privacy: PrivacyEngine | None = None,
) -> Coordinator:
    """A coordinator on the hub for `settings`, starting from its task's seed-0 model."""
    task = load_task(settings.task)
    model = task.build_model(0)
    return build_coordinator(
        lambda: broker.connect("coordinator"),
        plan_stages(settings, task, model),
        model,
        engine,
        privacy=privacy,
    )


def record_waits(coordinator: Coordinator, waits: list[tuple[float, bool]]) -> None:
    """Append each wait of the coordinator's transport to `waits`: timeout, whether it was met."""
    transport = coordinator.transport
    waited = transport.wait_until

    def recorded(predicate: Callable[[], bool], timeout_s: float) -> bool:
        done = waited(predicate, timeout_s)
        waits.append((timeout_s, done))
        return done

    transport.wait_until = recorded  # type: ignore[method-assign]


def update_frame(
    announcement: RoundAnnouncement, device_id: str, tensors: dict[str, torch.Tensor]
) -> bytes:
    """A framed update of `tensors` from `device_id` to `announcement`: one sample, loss 0."""
    manifest, blob = pack_tensors(tensors)
    update = DeviceUpdate(
        run_id=announcement.run_id,
        round_id=announcement.round_id,
        device_id=device_id,
        algorithm=announcement.algorithm,
        num_samples=1,
        train_loss=0.0,
        manifest=manifest,
    )
    return encode_frame(update, blob)


def hub_agents(
    broker: InProcessBroker,
    device_ids: Sequence[str],
    extra: Callable[[int], dict[str, Any]] = lambda index: {},
    task: Task | None = None,
) -> list[DeviceAgent]:
    """Started agents on the shards of a fleet of len(device_ids); `extra(i)` overrides.

    The task is digits unless given.
    """
    task = task or load_task(TASK)
    shards = task.make_fleet(len(device_ids), PartitionSpec(), 0)
    agents = []
    for index, device_id in enumerate(device_ids):
        workspace = task.build_model(0)
        arguments: dict[str, Any] = {
            "device_id": device_id,
            "fleet": "default",
            "transport": broker.connect(device_id),
            "task": task,
            "data": shards[index],
            "seed": 0,
            "store": MemoryStateStore(),
            "workspace": workspace,
            "initial_state": {k: v.clone() for k, v in workspace.state_dict().items()},
        }
        agent = DeviceAgent(**{**arguments, **extra(index)})
        agent.start()
        agents.append(agent)
    return agents


def hub_agent(
    broker: InProcessBroker,
    device_id: str,
    task: Task,
    data: DeviceData,
    *,
    will: bool = True,
    **overrides: Any,
) -> DeviceAgent:
    """One agent (not started) on the hub: the task's seed-0 model as its starting state.

    With `will`, its connection leaves the offline status a crashed device's broker publishes.
    """
    workspace = task.build_model(0)
    transport = broker.connect(device_id, device_will("default", device_id) if will else None)
    arguments: dict[str, Any] = {
        "device_id": device_id,
        "fleet": "default",
        "transport": transport,
        "task": task,
        "data": data,
        "seed": 0,
        "store": MemoryStateStore(),
        "workspace": workspace,
        "initial_state": dict(workspace.state_dict()),
    }
    return DeviceAgent(**{**arguments, **overrides})


def hub_impostor(
    broker: InProcessBroker,
    device_id: str,
    on_announcement: Callable[[Transport, RoundAnnouncement], None],
) -> None:
    """A client with a device's identity that joins with 10 samples and reacts to each round."""
    transport = broker.connect(device_id)

    def on_round(_topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if isinstance(message, RoundAnnouncement):
            on_announcement(transport, message)

    transport.subscribe(topics.round_announcement("default"), on_round)
    hello = DeviceHello(
        device_id=device_id, task=TASK, num_train_samples=10, capabilities=probe_capabilities()
    )
    transport.publish(topics.device("default", device_id, "hello"), encode_frame(hello))
