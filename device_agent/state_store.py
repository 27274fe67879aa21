"""Where a device keeps its personal state between rounds: in memory (simulation) or on disk.

On disk, state is one safetensors file plus a JSON record of the format version, a fingerprint
of the task, architecture and split, and the run it belongs to, each written atomically (temp
file, fsync, rename), so a crash at any point leaves either the old state or the new one, and a
mismatched state is refused. A new run starts from fresh personal state; the last state of the
previous run is moved to `earlier-runs/<run id>/` rather than overwritten.
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
EARLIER_RUNS: Final = "earlier-runs"


class StateStore(Protocol):
    """Personal tensors that outlive a round."""

    def load(self, fingerprint: str, run_id: str = "") -> Tensors | None:
        """The stored tensors, or None if nothing is stored yet or it is another run's.

        `run_id` "" takes whatever run's state is stored.

        Raises:
            StateError: stored state belongs to another task, architecture or split.
        """
        ...

    def save(self, fingerprint: str, tensors: Tensors, run_id: str = "") -> None:
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
        self._run_id = ""
        self._tensors: Tensors | None = None

    def load(self, fingerprint: str, run_id: str = "") -> Tensors | None:
        """The tensors saved under `fingerprint` in this run."""
        if self._tensors is None or not _same_run(self._run_id, run_id):
            return None
        _check_fingerprint(self._fingerprint, fingerprint, "memory")
        return self._tensors

    def save(self, fingerprint: str, tensors: Tensors, run_id: str = "") -> None:
        """Keep `tensors` (already private copies)."""
        self._fingerprint, self._tensors, self._run_id = fingerprint, tensors, run_id

    def clear(self) -> None:
        """Forget the state."""
        self._fingerprint, self._tensors, self._run_id = None, None, ""


class DiskStateStore:
    """Personal state in a directory that survives agent restarts."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def load(self, fingerprint: str, run_id: str = "") -> Tensors | None:
        """Read back this run's state, refusing a format or fingerprint that does not match."""
        record = self._record()
        if record is None:
            return None
        if not _same_run(str(record.get("run_id", "")), run_id):
            logger.info(
                "personal state in %s is from another run: run %s starts fresh",
                self.directory,
                run_id[:8],
            )
            return None
        try:
            blob = (self.directory / TENSORS_FILE).read_bytes()
        except OSError as error:
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

    def save(self, fingerprint: str, tensors: Tensors, run_id: str = "") -> None:
        """Write tensors, then the record that names them; each file atomically.

        The first save of a new run first moves the earlier run's files aside.
        """
        blob = save_safetensors({k: v.detach().contiguous() for k, v in tensors.items()})
        record = {"format_version": STATE_FORMAT_VERSION, "fingerprint": fingerprint}
        if run_id:
            record["run_id"] = run_id
        self.directory.mkdir(parents=True, exist_ok=True)
        self._set_aside_other_run(run_id)
        write_atomically(self.directory / TENSORS_FILE, blob)
        write_atomically(self.directory / RECORD_FILE, json.dumps(record).encode())

    def clear(self) -> None:
        """Remove the stored files."""
        for name in (RECORD_FILE, TENSORS_FILE):
            (self.directory / name).unlink(missing_ok=True)

    def _record(self) -> dict[str, object] | None:
        path = self.directory / RECORD_FILE
        if not path.exists():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            msg = f"cannot read personal state in {self.directory}: {error}"
            raise StateError(msg) from error
        if not isinstance(record, dict):
            msg = f"personal state record in {self.directory} is not a JSON object"
            raise StateError(msg)
        return record

    def _set_aside_other_run(self, run_id: str) -> None:
        """Move another run's state to `earlier-runs/<its run id>/` (one per run, the last)."""
        try:
            record = self._record()
        except StateError:
            record = {}  # unreadable: set it aside all the same, under "unknown"
        if record is None or not run_id or _same_run(str(record.get("run_id", "")), run_id):
            return
        earlier = str(record.get("run_id", "")) or "unknown"
        target = self.directory / EARLIER_RUNS / earlier
        try:
            target.mkdir(parents=True, exist_ok=True)
            for name in (TENSORS_FILE, RECORD_FILE):  # the record last: it names the tensors
                if (self.directory / name).exists():
                    (self.directory / name).replace(target / name)
        except OSError as error:
            msg = f"cannot set aside the earlier run's personal state in {self.directory}: {error}"
            raise StateError(msg) from error
        logger.info("personal state of earlier run %s moved to %s", earlier[:8], target)


def _same_run(stored: str, wanted: str) -> bool:
    """Whether state stored for run `stored` belongs to run `wanted` ("" wants any run)."""
    return not wanted or stored == wanted


def _check_fingerprint(stored: object, expected: str, where: str) -> None:
    if stored != expected:
        msg = (
            f"personal state in {where} was made for another task, architecture or split "
            f"(fingerprint {str(stored)[:12]} != {expected[:12]}); run `pfl-agent reset-state`"
        )
        raise StateError(msg)
