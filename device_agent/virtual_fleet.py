"""Virtual devices: real `DeviceAgent`s for a range of a simulated fleet, one process holding many.

Simulation (in one process or in worker processes) and `pfl-agent pool` (real MQTT clients on
several machines) build them here, so device `dev-0042` holds the same data and seed wherever
it runs. The agents of one process share one workspace model and one decoded-model cache: only
their personal state is their own, which keeps an idle virtual device small. MQTT clients call
handlers on a thread each, so there a lock lets one handler run at a time.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from device_agent.agent import DeviceAgent, device_will
from device_agent.attacks import HONEST, AttackPlan, Coalition
from device_agent.batched.trainer import LocalTrainer
from device_agent.capabilities import probe_capabilities
from device_agent.compute_threads import StepThreads, largest_step_macs
from device_agent.received import DecodedModelCache
from device_agent.state_store import MemoryStateStore
from pfl_tasks.base import DeviceData, PartitionSpec, Task
from protocols.codec import Tensors
from protocols.transport.base import (
    MessageHandler,
    ReconnectHook,
    Transport,
    TransportWrapper,
    Will,
)

Connect = Callable[[str, Will], Transport]


def device_name(index: int) -> str:
    """The id of virtual device `index`."""
    return f"dev-{index:04d}"


def parse_device_range(text: str) -> range:
    """`"0-499"` (inclusive) or `"7"`: the indices of a pool's virtual devices.

    Raises:
        ValueError: not `N` or `A-B` with A <= B.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
        msg = f"--devices {text!r}: expected a range such as 0-499 (first-last, inclusive) or 7"
        raise ValueError(msg)
    first = int(match[1])
    return range(first, int(match[2] or first) + 1)


@dataclass(frozen=True)
class VirtualFleet:
    """What every virtual device of one simulated fleet shares."""

    fleet: str
    task: Task
    data: Sequence[DeviceData]
    """Every device's data, indexed by device: a range picks its own."""
    seed: int
    stateful: bool
    initial_state: Tensors
    attack: AttackPlan | None = None
    """Simulation only: which devices lie, and how (None: all honest)."""

    @classmethod
    def create(
        cls,
        *,
        fleet: str,
        task: Task,
        devices: int,
        partition: PartitionSpec,
        seed: int,
        stateful: bool,
        attack: AttackPlan | None = None,
    ) -> VirtualFleet:
        """The fleet of `devices` that `task`'s data split by `partition` and `seed` gives."""
        model = task.build_model(seed)
        return cls(
            fleet=fleet,
            task=task,
            data=task.make_fleet(devices, partition, seed),
            seed=seed,
            stateful=stateful,
            initial_state={k: v.detach().clone() for k, v in model.state_dict().items()},
            attack=attack,
        )

    def class_count(self) -> int:
        """The classes the task's model predicts (its output width; 0 unless accuracy)."""
        if self.task.metric_name != "accuracy":
            return 0
        with torch.no_grad():
            outputs = self.task.build_model(self.seed)(self.data[0].train.inputs[:1])
        return int(outputs.shape[-1])

    def step_macs(self, batch_size: int) -> int:
        """Multiply-adds of the largest training step at `batch_size` (0: no data)."""
        inputs = [data.train.inputs for data in self.data]
        return largest_step_macs(self.task.build_model(self.seed), inputs, batch_size)

    def step_threads(self, indices: Iterable[int], cores: int) -> StepThreads:
        """Threads, at most `cores`, for the training steps of the devices at `indices`."""
        inputs = (self.data[index].train.inputs for index in indices)
        return StepThreads(self.task.build_model(self.seed), inputs, cores)

    def build(
        self,
        indices: Iterable[int],
        connect: Connect,
        *,
        threaded: bool,
        threads: StepThreads | None = None,
        trainer: LocalTrainer | None = None,
    ) -> list[DeviceAgent]:
        """Started agents for `indices`, connected through `connect(device_id, will)`.

        `threaded`: the transports call handlers on threads of their own (MQTT), so a lock
        serializes the handlers of all these agents. `threads`: each round's torch threads
        (None: the process's setting). `trainer`: where their local updates run (None: each
        at once; `device_agent.batched.trainer.Batched` trains a round's worth together).
        """
        workspace = self.task.build_model(self.seed)
        cache = DecodedModelCache()
        capabilities = probe_capabilities()
        one_at_a_time = threading.Lock() if threaded else None
        coalition, classes = Coalition(), self._attack_classes()
        agents = []
        for index in indices:
            device_id = device_name(index)
            attack = (
                HONEST
                if self.attack is None
                else self.attack.attack(index, device_id, coalition, classes)
            )
            transport = connect(device_id, device_will(self.fleet, device_id))
            if one_at_a_time is not None:
                transport = SerializedTransport(transport, one_at_a_time)
            agent = DeviceAgent(
                device_id=device_id,
                fleet=self.fleet,
                transport=transport,
                task=self.task,
                data=attack.train_data(self.data[index]),
                seed=self.seed,
                store=MemoryStateStore(),
                workspace=workspace,
                initial_state=self.initial_state,
                stateful=self.stateful,
                capabilities=capabilities,
                model_cache=cache,
                threads=threads,
                attack=attack,
                reproducible_noise=True,  # the same for any number of workers
                trainer=trainer,
            )
            agent.start()
            agents.append(agent)
        return agents

    def _attack_classes(self) -> int:
        """label-flip's class count (0 for other attacks).

        Raises:
            ValueError: label-flip on a task without classes.
        """
        if self.attack is None or self.attack.name != "label-flip":
            return 0
        classes = self.class_count()
        if classes < 2:
            msg = f"label-flip needs a classification task; {self.task.name} has no classes"
            raise ValueError(msg)
        return classes


class SerializedTransport(TransportWrapper):
    """A transport whose handlers take `lock`: many such agents may share one workspace."""

    def __init__(self, inner: Transport, lock: threading.Lock) -> None:
        super().__init__(inner)
        self.lock = lock

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Subscribe with `handler` run under the lock."""

        def serialized(topic: str, payload: bytes) -> None:
            with self.lock:
                handler(topic, payload)

        self.inner.subscribe(pattern, serialized)

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        """Hear of reconnects with `hook` run under the lock, as handlers are."""
        if hook is None:
            self.inner.on_reconnect(None)
            return

        def serialized() -> None:
            with self.lock:
                hook()

        self.inner.on_reconnect(serialized)
