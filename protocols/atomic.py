"""Atomic file replacement (temp file, fsync, rename), shared by device state and checkpoints."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from protocols.errors import StateError


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see the old or the new content, never a mix.

    Raises:
        StateError: the write failed (disk full, permissions); `path` is untouched.
    """
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        msg = f"cannot write {path}: {error}"
        raise StateError(msg) from error
