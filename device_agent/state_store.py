"""Where a device keeps its personal state between rounds: in memory (simulation) or on disk.

On disk, state is one safetensors file plus a JSON record of the format version and a fingerprint
of the task, architecture and split, each written atomically (temp file, fsync, rename), so a
crash at any point leaves either the old state or the new one, and a mismatched state is refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Final, Protocol

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from protocols.atomic import write_atomically
from protocols.codec import Tensors
from protocols.errors import StateError

logger = logging.getLogger(__name__)

STATE_FORMAT_VERSION: Final = 1
TENSORS_FILE: Final = "personal.safetensors"
RECORD_FILE: Final = "personal.json"


class StateStore(Protocol):
    """Personal tensors that outlive a round."""

    def load(self, fingerprint: str) -> Tensors | None:
        """The stored tensors, or None if nothing is stored yet.

        Raises:
            StateError: stored state belongs to another task, architecture or split.
        """
        ...

    def save(self, fingerprint: str, tensors: Tensors) -> None:
        """Replace the stored tensors atomically.

        Raises:
            StateError: the write failed (e.g. disk full); the previous state is intact.
        """
        ...

    def clear(self) -> None:
        """Forget everything stored."""
        ...


class MemoryStateStore:
    """Personal state of a virtual device: its own tensors only, never a full model copy."""

    def __init__(self) -> None:
        self._fingerprint: str | None = None
        self._tensors: Tensors | None = None

    def load(self, fingerprint: str) -> Tensors | None:
        """The tensors saved under `fingerprint`."""
        if self._tensors is None:
            return None
        _check_fingerprint(self._fingerprint, fingerprint, "memory")
        return self._tensors

    def save(self, fingerprint: str, tensors: Tensors) -> None:
        """Keep `tensors` (already private copies)."""
        self._fingerprint, self._tensors = fingerprint, tensors

    def clear(self) -> None:
        """Forget the state."""
        self._fingerprint, self._tensors = None, None


class DiskStateStore:
    """Personal state in a directory that survives agent restarts."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def load(self, fingerprint: str) -> Tensors | None:
        """Read back the state, refusing a format or fingerprint that does not match."""
        record_path = self.directory / RECORD_FILE
        if not record_path.exists():
            return None
        try:
            record = json.loads(record_path.read_text())
            blob = (self.directory / TENSORS_FILE).read_bytes()
        except (OSError, ValueError) as error:
            msg = f"cannot read personal state in {self.directory}: {error}"
            raise StateError(msg) from error
        if record.get("format_version") != STATE_FORMAT_VERSION:
            msg = (
                f"personal state in {self.directory} has format {record.get('format_version')}, "
                f"this build reads {STATE_FORMAT_VERSION}; run `pfl-agent reset-state`"
            )
            raise StateError(msg)
        _check_fingerprint(record.get("fingerprint"), fingerprint, str(self.directory))
        try:
            return dict(load_safetensors(blob))
        except SafetensorError as error:
            msg = f"personal state in {self.directory} is corrupt: {error}"
            raise StateError(msg) from error

    def save(self, fingerprint: str, tensors: Tensors) -> None:
        """Write tensors, then the record that names them; each file atomically."""
        blob = save_safetensors({k: v.detach().contiguous() for k, v in tensors.items()})
        record = {"format_version": STATE_FORMAT_VERSION, "fingerprint": fingerprint}
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self.directory / TENSORS_FILE, blob)
        write_atomically(self.directory / RECORD_FILE, json.dumps(record).encode())

    def clear(self) -> None:
        """Remove the stored files."""
        for name in (RECORD_FILE, TENSORS_FILE):
            (self.directory / name).unlink(missing_ok=True)


def _check_fingerprint(stored: object, expected: str, where: str) -> None:
    if stored != expected:
        msg = (
            f"personal state in {where} was made for another task, architecture or split "
            f"(fingerprint {str(stored)[:12]} != {expected[:12]}); run `pfl-agent reset-state`"
        )
        raise StateError(msg)
