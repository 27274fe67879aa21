"""A round stage behind the engine's seam: it sees every round and its state is checkpointed.

The engine names no feature: a stage it has never heard of (`_Frozen` here) is given to the
constructor, transforms the round's updates, adds its scalars, and a checkpoint keeps its state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.checkpoint import load_checkpoint, restore_checkpoint, save_checkpoint
from coordinator.stages.base import Collected, RoundStage, Skipped
from coordinator.strategies import build_strategy
from coordinator.strategies.base import FleetSnapshot, ReceivedUpdate
from pfl_tasks.registry import load_task
from protocols.algorithms import parse_algorithm_config
from protocols.errors import StateError
from protocols.messages import DevicePrivacy, SecureRound
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import TASK, hub_agents

DEVICES = ("dev-0", "dev-1", "dev-2")


class _Frozen:
    """Lets every round run, but zeroes its updates: the model never moves."""

    name = "frozen"

    def __init__(self) -> None:
        self.rounds = 0
        self.seen: list[int] = []

    def cohort(self, fleet: FleetSnapshot, rng: np.random.Generator) -> FleetSnapshot:
        return fleet

    def releases_empty(self, fleet: FleetSnapshot) -> bool:
        return False

    def device_privacy(self, fleet: FleetSnapshot, selected: Sequence[str]) -> DevicePrivacy | None:
        return None

    def aggregation(self, buffer: int) -> DevicePrivacy | None:
        return None

    def dealt(self, secure: SecureRound, dimension: int) -> None:
        pass

    def transform(
        self, updates: list[ReceivedUpdate], shared: Mapping[str, torch.Tensor], presummed: bool
    ) -> list[ReceivedUpdate]:
        self.seen.append(len(updates))
        return [
            ReceivedUpdate(u.device_id, u.num_samples, u.train_loss, {
                n: torch.zeros_like(t) for n, t in u.shared_delta.items()})
            for u in updates
        ]  # fmt: skip

    def release(self, collected: Collected, scalars: dict[str, float]) -> None:
        self.rounds += 1
        scalars["frozen_rounds"] = float(self.rounds)

    def skipped(self, skipped: Skipped) -> dict[str, float]:
        return {}

    def train_loss(self, loss: float) -> float:
        return -loss

    def state(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state.get("rounds"), int):
            msg = "no round count"
            raise ValueError(msg)
        self.rounds = state["rounds"]


def _coordinator(broker: InProcessBroker, stages: tuple[RoundStage, ...]) -> Coordinator:
    model = load_task(TASK).build_model(0)
    return Coordinator(
        broker.connect("coordinator"),
        build_strategy(parse_algorithm_config("fedavg", {}), 1.0),
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        EngineSettings(task=TASK, rounds=2, quorum=1.0, round_timeout_s=30.0),
        stages=stages,
    )


def test_a_stage_the_engine_does_not_know_sees_every_round_and_is_checkpointed(
    tmp_path: Path,
) -> None:
    # Prepare: three real agents on the in-process hub
    broker, stage = InProcessBroker(), _Frozen()
    coordinator = _coordinator(broker, (stage,))
    before = {k: v.clone() for k, v in coordinator.shared.items()}
    coordinator.start()
    hub_agents(broker, DEVICES)
    assert coordinator.wait_for_devices(len(DEVICES), 5.0)
    # Execute
    records = [coordinator.run_round() for _ in range(2)]
    save_checkpoint(tmp_path, coordinator, {})
    # Assert: the stage transformed each round's three updates; the model never moved
    assert stage.seen == [3, 3]
    assert [r.scalars["frozen_rounds"] for r in records] == [1.0, 2.0]
    assert all(r.train_loss < 0 and math.isfinite(r.train_loss) for r in records)
    assert all(torch.equal(coordinator.shared[k], v) for k, v in before.items())
    resumed_stage = _Frozen()
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint is not None
    assert checkpoint.record.stages == {"frozen": {"rounds": 2}}
    restore_checkpoint(_coordinator(InProcessBroker(), (resumed_stage,)), checkpoint)
    assert resumed_stage.rounds == 2


def test_a_checkpoint_without_a_stages_state_or_with_a_broken_one_is_refused(
    tmp_path: Path,
) -> None:
    save_checkpoint(tmp_path, _coordinator(InProcessBroker(), ()), {})
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint is not None
    fresh = _coordinator(InProcessBroker(), (_Frozen(),))
    with pytest.raises(StateError, match="holds no frozen state"):
        restore_checkpoint(fresh, checkpoint)
    assert fresh.round_id == 0  # nothing was restored
    broken = checkpoint.record.model_copy(update={"stages": {"frozen": {"rounds": "two"}}})
    with pytest.raises(StateError, match="the checkpoint's frozen state: no round count"):
        restore_checkpoint(fresh, type(checkpoint)(broken, checkpoint.model))
