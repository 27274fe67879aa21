"""A model's integer tensors (BatchNorm's step counter) never leave the device, DP or not.

Clipping and noise apply to floating tensors only; `num_batches_tracked` would travel exact and
give away how many local steps, hence how many samples, the device trained on, and a float mean
of counts is no count. Running statistics leave only when shared (--norm-stats shared).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from coordinator.engine.rounds import EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from coordinator.stages.privacy import privacy_engine
from pfl_tasks.digits import NUM_CLASSES, NUM_PIXELS, DigitsTask
from pfl_tasks.models import build_seeded
from protocols import topics
from protocols.codec import decode_frame, unpack_tensors
from protocols.messages import DeviceUpdate
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents

COUNTER = "norm.num_batches_tracked"
MEAN = "norm.running_mean"
DEVICES = ("dev-a", "dev-b", "dev-c")


class NormedDigitsTask(DigitsTask):
    """Digits with a BatchNorm layer after the hidden one."""

    name: ClassVar[str] = "normed-digits"

    def build_model(self, seed: int) -> nn.Module:
        """An MLP whose hidden layer is batch-normalized."""
        return build_seeded(
            seed,
            lambda: nn.Sequential(
                OrderedDict(
                    hidden=nn.Linear(NUM_PIXELS, 32),
                    norm=nn.BatchNorm1d(32),
                    act=nn.ReLU(),
                    output=nn.Linear(32, NUM_CLASSES),
                )
            ),
        )


def _run(run: dict[str, Any]) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Two rounds of FedAvg on three devices: each update's tensors, the shared model."""
    broker = InProcessBroker()
    task = NormedDigitsTask()
    settings = SimulationSettings.load(
        None,
        task="digits",
        algorithm="fedavg",
        devices=len(DEVICES),
        rounds=2,
        batch_size=4096,  # one batch per epoch: BatchNorm needs more than one sample
        **run,
    )
    model = task.build_model(0)
    coordinator = build_coordinator(
        lambda: broker.connect("coordinator"),
        plan_stages(settings, task, model),
        model,
        EngineSettings(task=task.name, rounds=2, quorum=1.0),
        privacy=privacy_engine(settings.privacy(), settings.participation, 0),
    )
    updates: list[dict[str, torch.Tensor]] = []

    def spy(topic: str, payload: bytes) -> None:
        header, blob = decode_frame(payload)
        assert isinstance(header, DeviceUpdate)
        updates.append(unpack_tensors(header.manifest, blob))

    broker.connect("spy").subscribe(topics.device_subscription("default", "update"), spy)
    hub_agents(broker, DEVICES, task=task)
    coordinator.start()
    coordinator.wait_for_devices(len(DEVICES), 1.0)
    coordinator.run_round()
    coordinator.run_round()
    return updates, dict(coordinator.shared)


@pytest.mark.parametrize(
    "run",
    [
        {},
        {"norm_stats": "shared"},
        {"dp_noise": 1.0},
        {"dp_noise": 1.0, "norm_stats": "shared"},
        {"dp_noise": 1.0, "dp_placement": "device", "secagg": True},
        {"dp_noise": 1.0, "dp_placement": "device", "secagg": True, "norm_stats": "shared"},
    ],
    ids=["plain", "shared", "dp", "dp-shared", "dp-device-secagg", "dp-device-secagg-shared"],
)
def test_the_step_counter_is_never_sent_and_stays_the_coordinators(run: dict[str, Any]) -> None:
    updates, shared = _run(run)
    assert len(updates) == 2 * len(DEVICES)
    assert all(COUNTER not in update for update in updates)
    assert COUNTER not in shared  # no mean of counts exists anywhere
    averaged = run.get("norm_stats") == "shared"
    assert (MEAN in shared) == averaged
    if averaged:  # moved from its initial zeros by the devices' statistics
        assert float(shared[MEAN].abs().sum()) > 0
    if "secagg" not in run:  # a masked update is one flat vector, not named tensors
        assert {MEAN in update for update in updates} == {averaged}
