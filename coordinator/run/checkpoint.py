"""Coordinator checkpoints: everything a resumed run needs to continue as if never stopped.

A checkpoint is a safetensors file of the shared tensors, named by round, plus `checkpoint.json`
naming it. Both are written atomically and the record last, so a crash at any point leaves the
previous checkpoint or the new one, never a mix; older tensor files are removed afterwards.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from coordinator.engine.rounds import Coordinator
from protocols.atomic import write_atomically
from protocols.codec import Tensors
from protocols.errors import StateError

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION: Final = 1
RECORD_FILE: Final = "checkpoint.json"


class CheckpointDevice(BaseModel):
    """A device the fleet knew at checkpoint time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_id: str
    num_train_samples: int = Field(ge=0)


class CheckpointRecord(BaseModel):
    """The JSON half of a checkpoint; `tensors_file` names the safetensors half."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int
    run_id: str = ""
    """The run the checkpoint belongs to: a resumed run announces it again ("" before v2)."""
    round_id: int = Field(ge=0)
    shared_names: tuple[str, ...]
    tensors_file: str
    strategy_state: dict[str, Any]
    strategy_tensors_file: str = ""
    fleet: tuple[CheckpointDevice, ...]
    settings: dict[str, Any]
    rng_state: dict[str, Any]
    bytes_up: int = 0
    bytes_down: int = 0
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Each round stage's state by its name (`RoundStage.state`): e.g. DP's epsilon spent, its
    clip, its noise stream and DP-FTRL's tree."""
    privacy_state: dict[str, Any] | None = None
    """Read from older checkpoints only: the DP stage's state before `stages` held it."""

    def stage_states(self) -> dict[str, dict[str, Any]]:
        """`stages`, with an older checkpoint's DP state under its stage's name."""
        if self.privacy_state is None or "privacy" in self.stages:
            return dict(self.stages)
        return {**self.stages, "privacy": self.privacy_state}


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint."""

    record: CheckpointRecord
    model: Tensors
    strategy_tensors: Tensors = field(default_factory=dict)


def save_checkpoint(directory: Path, coordinator: Coordinator, settings: dict[str, Any]) -> Path:
    """Write the coordinator's state after a completed round; returns the record's path.

    Raises:
        StateError: a write failed; the previous checkpoint is intact.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tensors_file = f"shared-{coordinator.round_id:06d}.safetensors"
    blob = save_safetensors({k: v.detach().contiguous() for k, v in coordinator.model.items()})
    write_atomically(directory / tensors_file, blob)
    strategy_file = ""
    state = coordinator.relay.state_tensors()  # a relay's model per device: not JSON
    if state:
        strategy_file = f"strategy-{coordinator.round_id:06d}.safetensors"
        write_atomically(
            directory / strategy_file,
            save_safetensors({k: v.detach().contiguous() for k, v in state.items()}),
        )
    record = CheckpointRecord(
        format_version=CHECKPOINT_FORMAT_VERSION,
        run_id=coordinator.run_id,
        round_id=coordinator.round_id,
        shared_names=coordinator.shared_names,
        tensors_file=tensors_file,
        strategy_state=dict(coordinator.strategy.state_dict()),
        strategy_tensors_file=strategy_file,
        fleet=tuple(
            CheckpointDevice(device_id=r.device_id, num_train_samples=r.num_train_samples)
            for r in coordinator.registry.records()
        ),
        settings=settings,
        rng_state=dict(coordinator.rng.bit_generator.state),
        bytes_up=coordinator.bytes_up,
        bytes_down=coordinator.bytes_down,
        stages={stage.name: stage.state() for stage in coordinator.stages},
    )
    path = directory / RECORD_FILE
    write_atomically(path, record.model_dump_json(indent=2).encode())
    for old in (*directory.glob("shared-*.safetensors"), *directory.glob("strategy-*.safetensors")):
        if old.name not in (tensors_file, strategy_file):
            old.unlink(missing_ok=True)
    logger.debug("checkpoint of round %d written to %s", coordinator.round_id, directory)
    return path


def load_checkpoint(directory: Path) -> Checkpoint | None:
    """The last checkpoint in `directory`, or None if there is none.

    Raises:
        StateError: the checkpoint is unreadable, corrupt or of another format version.
    """
    path = directory / RECORD_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format_version") != CHECKPOINT_FORMAT_VERSION:
            msg = (
                f"checkpoint {path} has format {raw.get('format_version')}, "
                f"this build reads {CHECKPOINT_FORMAT_VERSION}"
            )
            raise StateError(msg)
        record = CheckpointRecord.model_validate(raw)
        model = dict(load_safetensors((directory / record.tensors_file).read_bytes()))
        strategy_tensors = {}
        if record.strategy_tensors_file:
            raw_tensors = (directory / record.strategy_tensors_file).read_bytes()
            strategy_tensors = dict(load_safetensors(raw_tensors))
    except (OSError, ValueError, ValidationError, SafetensorError) as error:
        msg = f"cannot read the checkpoint in {directory}: {error}"
        raise StateError(msg) from error
    return Checkpoint(record, model, strategy_tensors)


def restore_checkpoint(coordinator: Coordinator, checkpoint: Checkpoint) -> None:
    """Put the coordinator where it was after the checkpoint's round.

    Raises:
        StateError: the checkpoint's tensors do not match the task's shared parameters.
    """
    record = checkpoint.record
    expected = {k: (tuple(v.shape), v.dtype) for k, v in coordinator.model.items()}
    found = {k: (tuple(v.shape), v.dtype) for k, v in checkpoint.model.items()}
    if expected != found or record.shared_names != coordinator.shared_names:
        msg = "the checkpoint's tensors do not match this task, algorithm and stage"
        raise StateError(msg)
    try:  # e.g. DP's epsilon spent goes on, never starts again
        coordinator.stage.load_state(record.stage_states())
    except ValueError as error:
        raise StateError(str(error)) from error
    coordinator.model = dict(checkpoint.model)
    coordinator.round_id = record.round_id
    coordinator.run_id = record.run_id or coordinator.run_id
    coordinator.traffic.bytes_up = record.bytes_up
    coordinator.traffic.bytes_down = record.bytes_down
    coordinator.strategy.load_state_dict(record.strategy_state)
    coordinator.relay.load_state_tensors(checkpoint.strategy_tensors)
    coordinator.rng.bit_generator.state = record.rng_state
    for device in record.fleet:
        coordinator.registry.restore(device.device_id, device.num_train_samples)
