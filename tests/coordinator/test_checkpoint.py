"""Coordinator checkpoints round-trip every piece a resumed run needs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from coordinator.checkpoint import load_checkpoint, restore_checkpoint, save_checkpoint
from coordinator.rounds import Coordinator, EngineSettings
from coordinator.strategies import build_strategy
from device_agent.capabilities import probe_capabilities
from protocols.algorithms import parse_algorithm_config
from protocols.errors import StateError
from protocols.messages import DeviceHello
from protocols.transport.inprocess import InProcessBroker


def _coordinator(seed: int = 3) -> Coordinator:
    shared = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    return Coordinator(
        InProcessBroker().connect("coord"),
        build_strategy(parse_algorithm_config("fedavg", {}), 0.5),
        shared,
        EngineSettings(seed=seed),
    )


def test_a_checkpoint_restores_round_tensors_fleet_and_rng(tmp_path) -> None:
    # Prepare: a coordinator some way into a run
    original = _coordinator()
    original.round_id = 4
    original.shared = {"w": torch.ones(2, 3), "b": torch.full((3,), 2.0)}
    original.rng.random(5)
    hello = DeviceHello(
        device_id="dev-7", task="t", num_train_samples=42, capabilities=probe_capabilities()
    )
    original.registry.on_hello(hello)
    # Execute
    save_checkpoint(tmp_path, original, {"task": "t"})
    resumed = _coordinator()
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint is not None
    restore_checkpoint(resumed, checkpoint)
    # Assert
    assert resumed.round_id == 4
    assert torch.equal(resumed.shared["w"], torch.ones(2, 3))
    assert np.array_equal(resumed.rng.random(4), original.rng.random(4))
    assert [(r.device_id, r.num_train_samples, r.online) for r in resumed.registry.records()] == [
        ("dev-7", 42, False)
    ]
    assert checkpoint.record.settings == {"task": "t"}


def test_only_the_latest_tensors_file_is_kept(tmp_path) -> None:
    coordinator = _coordinator()
    for round_id in (1, 2, 3):
        coordinator.round_id = round_id
        save_checkpoint(tmp_path, coordinator, {})
    assert sorted(p.name for p in tmp_path.glob("shared-*")) == ["shared-000003.safetensors"]


def test_a_missing_checkpoint_is_none_and_a_foreign_one_is_refused(tmp_path) -> None:
    assert load_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, _coordinator(), {})
    record = json.loads((tmp_path / "checkpoint.json").read_text())
    record["format_version"] = 99
    (tmp_path / "checkpoint.json").write_text(json.dumps(record))
    with pytest.raises(StateError, match="format 99"):
        load_checkpoint(tmp_path)
