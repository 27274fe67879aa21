"""What a device received: the models it holds in memory, and the frames it keeps on disk.

A round works on the latest shared model, decoded once (`DecodedModelCache`: virtual devices in
one process share one). The last shared model and round announcement are kept in the state
directory too:

`pfl-agent export` runs offline, after the agent stopped: the personalized model needs the shared
model of the last round and the algorithm and config that announced it, and only the broker held
those. The agent therefore keeps the raw frames, each written atomically, the model only when it
changes (a retained re-delivery after a reconnect writes nothing).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from device_agent.state_store import DiskStateStore, StateStore
from protocols.atomic import write_atomically
from protocols.codec import (
    Tensors,
    decode_frame,
    join_owners,
    require_layout,
    split_owners,
    unpack_tensors,
)
from protocols.errors import PflError, ProtocolError, StateError
from protocols.messages import AnyMessage, RoundAnnouncement, SharedModel, TensorSpec

logger = logging.getLogger(__name__)

MODEL_FILE: Final = "shared-model.frame"
ROUND_FILE: Final = "round.frame"
RELAYED_FILE: Final = "relayed.safetensors"
RECORD_FILE: Final = "received.json"
MODEL_MISMATCH_HINT: Final = (
    " (the coordinator's model is not the one this agent builds: start it with the "
    "coordinator's --task and --model)"
)


@dataclass
class ReceivedModel:
    """A shared-model frame as received; `decoded` once validated against the model's layout."""

    header: SharedModel
    blob: bytes
    decoded: Tensors | None = None

    @classmethod
    def from_frame(cls, frame: bytes) -> ReceivedModel:
        """A kept shared-model frame (offline export), decoded when first used.

        Raises:
            ProtocolError: the frame is malformed or not a shared model.
        """
        message, blob = decode_frame(frame)
        if not isinstance(message, SharedModel):
            msg = f"expected a shared model, got {message.kind}"
            raise ProtocolError(msg)
        return cls(message, blob)


class DecodedModelCache:
    """Broadcast frames and shared models decoded once: virtual devices in one process share one.

    A broadcast reaches every virtual device as the same bytes object, so its parsed header is
    reused by identity; tensors are keyed by the manifest's SHA-256 and the expected layout, so
    equal keys mean equal tensors. Consumers only read them (loading copies).
    """

    def __init__(self) -> None:
        self._key: tuple[str, tuple[TensorSpec, ...]] | None = None
        self._tensors: Tensors = {}
        self._frames: list[tuple[bytes, tuple[AnyMessage, bytes]]] = []

    def frame(self, payload: bytes) -> tuple[AnyMessage, bytes]:
        """`decode_frame(payload)`, parsed once per broadcast payload object."""
        for seen, decoded in self._frames:
            if seen is payload:
                return decoded
        decoded = decode_frame(payload)
        self._frames = [(payload, decoded), *self._frames[:3]]
        return decoded

    def decode(self, model: ReceivedModel, expected: tuple[TensorSpec, ...]) -> Tensors:
        """The model's tensors, validated against `expected` on first use (kept on `model`)."""
        if model.decoded is None:
            key = (model.header.manifest.sha256, expected)
            if key != self._key:
                try:
                    require_layout(model.header.manifest, expected)
                except ProtocolError as error:  # another model, not a damaged one
                    msg = f"{error}{MODEL_MISMATCH_HINT}"
                    raise ProtocolError(msg) from error
                self._tensors = unpack_tensors(model.header.manifest, model.blob)
                self._key = key
            model.decoded = self._tensors
        return model.decoded


@dataclass(frozen=True)
class ReceivedState:
    """What an offline export starts from: the frames as received, and who received them."""

    model_frame: bytes
    announcement: RoundAnnouncement
    device_id: str
    relayed: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """A relay algorithm's models of the last evaluation (FedeRiCo's mixture), by owner."""


class ReceivedFrames:
    """Keeps the latest shared-model and round frames in `directory` (nothing when it is None).

    Virtual devices have no directory: a thousand of them must not write a model each per round.
    Write failures are logged, never raised: losing the offline-export copy must not stop a round.
    """

    def __init__(self, directory: Path | None, device_id: str) -> None:
        self.directory = directory
        self.device_id = device_id
        self._record: dict[str, object] = _read_record(directory) if directory else {}

    @classmethod
    def for_store(cls, store: StateStore, device_id: str) -> ReceivedFrames:
        """Frames beside a disk store's personal state; a memory store keeps none."""
        directory = store.directory if isinstance(store, DiskStateStore) else None
        return cls(directory, device_id)

    def remember_model(self, message: SharedModel, frame: bytes) -> None:
        """Write the shared-model frame unless the same model is already on disk."""
        if self.directory is None or self._record.get("model_sha256") == message.manifest.sha256:
            return
        self._write(
            self.directory,
            MODEL_FILE,
            frame,
            model_sha256=message.manifest.sha256,
            model_round_id=message.round_id,
        )

    def remember_round(self, message: RoundAnnouncement, frame: bytes) -> None:
        """Write the announcement frame when its round, phase, algorithm or config changed."""
        if self.directory is None:
            return
        key = json.dumps(
            [message.round_id, message.phase, message.algorithm, message.config], sort_keys=True
        )
        if self._record.get("round_key") == key:
            return
        self._write(self.directory, ROUND_FILE, frame, round_key=key)

    def remember_relayed(self, models: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Keep the models an evaluation was relayed: the mixture an offline export needs.

        Training relays are not kept: they change every round and export never uses them.
        """
        if self.directory is None:
            return
        tensors = {key: value.detach().contiguous() for key, value in join_owners(models).items()}
        self._write(self.directory, RELAYED_FILE, save_safetensors(tensors))

    def _write(self, directory: Path, name: str, frame: bytes, **record: object) -> None:
        updated = {**self._record, **record, "device_id": self.device_id}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_atomically(directory / name, frame)
            write_atomically(directory / RECORD_FILE, json.dumps(updated).encode())
        except (OSError, StateError) as error:
            logger.warning("device %s: cannot keep %s for export: %s", self.device_id, name, error)
            return
        self._record = updated


def load_received(directory: Path) -> ReceivedState:
    """The frames an agent kept in `directory`, validated.

    Raises:
        StateError: nothing was kept (the agent never saw a round) or a file is unreadable.
    """
    record = _read_record(directory)
    model_path, round_path = directory / MODEL_FILE, directory / ROUND_FILE
    if not model_path.exists() or not round_path.exists():
        msg = (
            f"no shared model and round announcement in {directory}: run `pfl-agent start` with "
            f"this --state-dir until it has received at least one round"
        )
        raise StateError(msg)
    try:
        model_frame = model_path.read_bytes()
        model, _ = decode_frame(model_frame)
        announcement, _ = decode_frame(round_path.read_bytes())
    except (OSError, PflError) as error:
        msg = f"cannot read the received frames in {directory}: {error}"
        raise StateError(msg) from error
    if not isinstance(model, SharedModel) or not isinstance(announcement, RoundAnnouncement):
        msg = f"the received frames in {directory} are not a shared model and a round"
        raise StateError(msg)
    return ReceivedState(
        model_frame, announcement, str(record.get("device_id", "")), _read_relayed(directory)
    )


def _read_relayed(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The kept relayed models by owner (none if there is no file).

    Raises:
        StateError: the file is unreadable or corrupt.
    """
    path = directory / RELAYED_FILE
    if not path.exists():
        return {}
    try:
        tensors = load_safetensors(path.read_bytes())
    except (OSError, SafetensorError) as error:
        msg = f"cannot read the relayed models in {path}: {error}"
        raise StateError(msg) from error
    return split_owners(tensors)


def _read_record(directory: Path) -> dict[str, object]:
    path = directory / RECORD_FILE
    try:
        record = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as error:
        logger.warning("ignoring unreadable %s: %s", path, error)
        return {}
    return record if isinstance(record, dict) else {}
