"""Coordinator checkpoints round-trip every piece a resumed run needs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.checkpoint import load_checkpoint, restore_checkpoint, save_checkpoint
from coordinator.strategies import build_strategy
from device_agent.capabilities import probe_capabilities
from protocols.algorithms import parse_algorithm_config
from protocols.atomic import write_atomically
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
    assert resumed.run_id == original.run_id != _coordinator().run_id  # a fresh one is new
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


def test_a_crash_during_a_checkpoint_write_leaves_the_previous_checkpoint(
    tmp_path, monkeypatch
) -> None:
    # Prepare: round 2 checkpointed; round 3's write dies after its tensors file, before the record
    import coordinator.run.checkpoint as checkpoint_module

    coordinator = _coordinator()
    coordinator.round_id = 2
    coordinator.shared = {"w": torch.full((2, 3), 2.0), "b": torch.zeros(3)}
    save_checkpoint(tmp_path, coordinator, {})
    real_write = write_atomically

    def crash_on_record(path, data):  # the process dies between the two files
        if path.name == "checkpoint.json":
            msg = "killed"
            raise StateError(msg)
        real_write(path, data)

    monkeypatch.setattr(checkpoint_module, "write_atomically", crash_on_record)
    coordinator.round_id = 3
    coordinator.shared = {"w": torch.full((2, 3), 3.0), "b": torch.zeros(3)}
    # Execute
    with pytest.raises(StateError):
        save_checkpoint(tmp_path, coordinator, {})
    monkeypatch.undo()
    checkpoint = load_checkpoint(tmp_path)
    # Assert: the resumed run starts after round 2, with round 2's tensors
    assert checkpoint is not None
    assert checkpoint.record.round_id == 2
    assert torch.equal(checkpoint.model["w"], torch.full((2, 3), 2.0))
