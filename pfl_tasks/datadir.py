"""A real device's own data on disk: train/val/test splits as .npz files, no pickle."""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Final

import numpy as np
import torch

from pfl_tasks.base import DeviceData, PartitionSpec, Split
from pfl_tasks.partition import split_samples

logger = logging.getLogger(__name__)

ARRAY_NAMES: Final = ("inputs", "targets")
REQUIRED_SPLITS: Final = ("train", "test")
OPTIONAL_SPLITS: Final = ("val",)


def load_device_data(directory: str | os.PathLike[str], device_index: int = 0) -> DeviceData:
    """Read a device's splits from `directory`/{train,test,val}.npz for the agent to train on.

    Each file holds arrays `inputs` and `targets` with one row per sample. Floating arrays become
    float32 (what models train in) and integer or boolean arrays int64 (class labels, token ids).
    val.npz is optional; without it the validation split is empty.

    Raises:
        ValueError: If a required file or array is missing or unreadable (including arrays that
            would need pickle), a dtype is unsupported, inputs and targets disagree on the sample
            count, the splits disagree on the per-sample shape, or train or test is empty.
    """
    root = Path(directory)
    if not root.is_dir():
        msg = f"data directory {str(root)!r} does not exist or is not a directory"
        raise ValueError(msg)
    splits: dict[str, Split] = {}
    for name in (*REQUIRED_SPLITS, *OPTIONAL_SPLITS):
        path = root / f"{name}.npz"
        if path.is_file():
            splits[name] = _load_split(path)
        elif name in REQUIRED_SPLITS:
            msg = f"missing {path.name} in {str(root)!r} (need {', '.join(REQUIRED_SPLITS)})"
            raise ValueError(msg)
    train, test = splits["train"], splits["test"]
    if "val" in splits:
        val = splits["val"]
    else:
        val = Split(
            train.inputs.new_empty((0, *train.inputs.shape[1:])),
            train.targets.new_empty((0, *train.targets.shape[1:])),
        )
    for split_name, split in (("train", train), ("test", test)):
        if len(split) == 0:
            msg = f"{split_name}.npz in {str(root)!r} holds no samples"
            raise ValueError(msg)
    for split_name, split in (("val", val), ("test", test)):
        for array, reference in (("inputs", train.inputs), ("targets", train.targets)):
            other = getattr(split, array)
            if other.shape[1:] != reference.shape[1:] or other.dtype != reference.dtype:
                msg = (
                    f"{split_name}.npz {array} have per-sample shape {tuple(other.shape[1:])} "
                    f"and dtype {other.dtype}, but train.npz has {tuple(reference.shape[1:])} "
                    f"and {reference.dtype} (in {str(root)!r})"
                )
                raise ValueError(msg)
    return DeviceData(device_index=device_index, train=train, val=val, test=test)


def save_device_data(data: DeviceData, directory: str | os.PathLike[str]) -> None:
    """Write a device's splits so `load_device_data` reads them back, each file atomically.

    A crash mid-write leaves either the previous file or the new one, never a torn file. Only the
    splits are written: `truth` and `device_index` are generator bookkeeping, not device data.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for split_name in ("train", "val", "test"):
        split: Split = getattr(data, split_name)
        arrays = {
            "inputs": split.inputs.detach().cpu().numpy(),
            "targets": split.targets.detach().cpu().numpy(),
        }
        _write_atomically(root / f"{split_name}.npz", arrays)
    _fsync_directory(root)


def _load_split(path: Path) -> Split:
    # Opening the file here, not in np.load, closes it even when the archive is corrupt.
    try:
        with path.open("rb") as stream:
            loaded = np.load(stream, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                msg = "a single array, not a .npz archive"
                raise ValueError(msg)
            with loaded as archive:
                found = list(archive.files)
                arrays = {name: archive[name] for name in ARRAY_NAMES if name in found}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        msg = f"cannot read {str(path)!r} as a .npz archive of plain arrays (no pickle): {error}"
        raise ValueError(msg) from error
    missing = [name for name in ARRAY_NAMES if name not in arrays]
    if missing:
        msg = (
            f"{path.name} lacks array(s) {', '.join(missing)}; it must hold "
            f"{' and '.join(ARRAY_NAMES)} (found: {', '.join(found) or 'none'})"
        )
        raise ValueError(msg)
    extra = sorted(set(found) - set(ARRAY_NAMES))
    if extra:
        logger.debug("ignoring extra arrays %s in %s", extra, path)
    inputs, targets = arrays["inputs"], arrays["targets"]
    if inputs.ndim == 0 or targets.ndim == 0:
        msg = f"{path.name}: inputs and targets need a leading sample axis (got 0-d arrays)"
        raise ValueError(msg)
    if inputs.shape[0] != targets.shape[0]:
        msg = (
            f"{path.name}: inputs have {inputs.shape[0]} samples but targets have "
            f"{targets.shape[0]}"
        )
        raise ValueError(msg)
    return Split(_to_tensor(inputs, path.name, "inputs"), _to_tensor(targets, path.name, "targets"))


def _to_tensor(array: np.ndarray, where: str, name: str) -> torch.Tensor:
    if np.issubdtype(array.dtype, np.floating):
        converted = array.astype(np.float32, copy=False)
    elif np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        converted = array.astype(np.int64, copy=False)
    else:
        msg = f"{where}: {name} have unsupported dtype {array.dtype}; use floats or integers"
        raise ValueError(msg)
    return torch.from_numpy(np.ascontiguousarray(converted))


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    temporary: str | None = None
    try:
        with tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
        ) as handle:
            temporary = handle.name
            np.savez(handle, inputs=arrays["inputs"], targets=arrays["targets"])
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise


def _fsync_directory(directory: Path) -> None:
    """Make the renames durable; not every platform can open a directory, which is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        logger.debug("could not fsync directory %s", directory)
    finally:
        os.close(fd)


def split_arrays(
    inputs: np.ndarray, targets: np.ndarray, spec: PartitionSpec, seed: int
) -> DeviceData:
    """One device's arrays shuffled into train, validation and test (the simulation's sizes).

    Floating arrays become float32 and integer or boolean arrays int64, as `load_device_data`
    reads them back.

    Raises:
        ValueError: inputs and targets disagree on the sample count, or too few samples.
    """
    if inputs.ndim == 0 or targets.ndim == 0 or inputs.shape[0] != targets.shape[0]:
        msg = f"inputs {inputs.shape} and targets {targets.shape} need one row per sample each"
        raise ValueError(msg)
    return split_samples(
        _to_tensor(inputs, "arrays", "inputs"),
        _to_tensor(targets, "arrays", "targets"),
        np.arange(inputs.shape[0]),
        spec,
        np.random.default_rng(seed),
    )


def read_csv_columns(path: str | os.PathLike[str], target: str) -> tuple[np.ndarray, np.ndarray]:
    """Numeric CSV columns as (inputs, targets): `target` names the targets, the rest are inputs.

    Targets whose every value is a whole number become integer class labels.

    Raises:
        ValueError: no such file or column, a non-numeric value, or no input column.
    """
    try:
        with Path(path).open(newline="") as stream:
            rows = list(csv.reader(stream))
    except OSError as error:
        msg = f"cannot read {str(path)!r}: {error.strerror or error}"
        raise ValueError(msg) from None
    if len(rows) < 2:
        msg = f"{str(path)!r} needs a header row and at least one data row"
        raise ValueError(msg)
    header = [name.strip() for name in rows[0]]
    if target not in header:
        msg = f"{str(path)!r} has no column {target!r} (columns: {', '.join(header)})"
        raise ValueError(msg)
    if len(header) < 2:
        msg = f"{str(path)!r} has no input column besides {target!r}"
        raise ValueError(msg)
    try:
        table = np.array([[float(cell) for cell in row] for row in rows[1:] if row], dtype=float)
    except ValueError as error:
        msg = f"{str(path)!r} holds a non-numeric value ({error}); encode it as numbers first"
        raise ValueError(msg) from None
    if table.shape[1] != len(header):
        msg = f"{str(path)!r}: rows have {table.shape[1]} cells, the header {len(header)}"
        raise ValueError(msg)
    column = header.index(target)
    values = table[:, column]
    targets = values.astype(np.int64) if np.all(values == np.round(values)) else values
    return np.delete(table, column, axis=1), targets


def load_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """One plain array from a .npy file (no pickle).

    Raises:
        ValueError: the file is missing or is not a plain .npy array.
    """
    try:
        array = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        msg = f"cannot read {str(path)!r} as a .npy array of plain numbers (no pickle): {error}"
        raise ValueError(msg) from None
    if not isinstance(array, np.ndarray):
        msg = f"{str(path)!r} is a .npz archive, not one .npy array"
        raise ValueError(msg)
    return array
