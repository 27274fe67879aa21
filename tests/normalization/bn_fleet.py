"""A three-device in-process fleet of a BatchNorm model, with every update wiretapped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.engine.rounds import EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from coordinator.stages.privacy import privacy_engine
from device_agent.state_store import MemoryStateStore
from pfl_tasks.base import Task
from protocols import topics
from protocols.codec import Tensors, decode_frame, unpack_tensors
from protocols.messages import DeviceUpdate
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents

DEVICES = ("dev-a", "dev-b", "dev-c")


class KeptStates(MemoryStateStore):
    """A device's store that also keeps a copy of what each round saved."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[Tensors] = []

    def save(self, fingerprint: str, tensors: Tensors, run_id: str = "") -> None:
        """Keep `tensors`, and a copy in `saved`."""
        self.saved.append({name: value.clone() for name, value in tensors.items()})
        super().save(fingerprint, tensors, run_id)


@dataclass
class FleetRun:
    """What a run left: each round's updates by device, the shared model, each device's store."""

    updates: list[dict[str, Tensors]] = field(default_factory=list)
    shared: Tensors = field(default_factory=dict)
    stores: dict[str, KeptStates] = field(default_factory=dict)


def run_fleet(task: Task, rounds: int = 2, **settings: Any) -> FleetRun:
    """`rounds` synchronous rounds of `settings` (FedAvg unless given) on three devices."""
    broker = InProcessBroker()
    values: dict[str, Any] = {"task": "digits", "algorithm": "fedavg", "devices": len(DEVICES)}
    run_settings = SimulationSettings.load(None, **{**values, "rounds": rounds, **settings})
    model = task.build_model(0)
    coordinator = build_coordinator(
        lambda: broker.connect("coordinator"),
        plan_stages(run_settings, task, model),
        model,
        EngineSettings(task=task.name, rounds=rounds, quorum=1.0),
        privacy=privacy_engine(run_settings.privacy(), run_settings.participation, 0),
    )
    run = FleetRun(stores={device: KeptStates() for device in DEVICES})

    def spy(topic: str, payload: bytes) -> None:
        header, blob = decode_frame(payload)
        assert isinstance(header, DeviceUpdate)
        run.updates[-1][header.device_id] = unpack_tensors(header.manifest, blob)

    broker.connect("spy").subscribe(topics.device_subscription("default", "update"), spy)
    hub_agents(broker, DEVICES, lambda i: {"store": run.stores[DEVICES[i]]}, task=task)
    coordinator.start()
    coordinator.wait_for_devices(len(DEVICES), 1.0)
    for _ in range(rounds):
        run.updates.append({})
        coordinator.run_round()
    run.shared = {name: value.clone() for name, value in coordinator.shared.items()}
    return run


def as_float(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in float64, for comparisons."""
    return tensor.to(torch.float64)
