"""Tests for reading and writing a device's own data directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pfl_tasks.base import DeviceData, PartitionSpec, Split
from pfl_tasks.datadir import load_device_data, save_device_data
from pfl_tasks.sine import SineTask


def _write(directory: Path, split: str, **arrays: np.ndarray) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / f"{split}.npz", **arrays)  # type: ignore[arg-type]  # numpy stubs read **kwds as allow_pickle


def _classification_dir(directory: Path) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 5)):
        _write(
            directory,
            split,
            inputs=rng.random((count, 8, 8)),
            targets=rng.integers(0, 3, count).astype(np.int32),
        )
    return directory


def test_round_trip_preserves_every_split(tmp_path: Path) -> None:
    # Prepare
    original = SineTask(n_val=4).make_fleet(2, PartitionSpec(), seed=0)[1]

    # Execute
    save_device_data(original, tmp_path / "device")
    loaded = load_device_data(tmp_path / "device", device_index=1)

    # Assert
    assert loaded.device_index == 1
    for name in ("train", "val", "test"):
        expected, actual = getattr(original, name), getattr(loaded, name)
        assert torch.equal(expected.inputs, actual.inputs)
        assert torch.equal(expected.targets, actual.targets)
        assert actual.inputs.dtype == torch.float32
    assert sorted(p.name for p in (tmp_path / "device").iterdir()) == [
        "test.npz",
        "train.npz",
        "val.npz",
    ]


def test_save_replaces_existing_files_and_leaves_no_temporaries(tmp_path: Path) -> None:
    # Prepare
    fleet = SineTask().make_fleet(2, PartitionSpec(), seed=1)
    save_device_data(fleet[0], tmp_path)

    # Execute
    save_device_data(fleet[1], tmp_path)

    # Assert
    loaded = load_device_data(tmp_path)
    assert torch.equal(loaded.train.inputs, fleet[1].train.inputs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.npz", "train.npz", "val.npz"]


def test_dtypes_are_normalized_and_val_is_optional(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)

    # Execute
    data = load_device_data(directory)

    # Assert
    assert data.train.inputs.dtype == torch.float32
    assert data.train.inputs.shape == (12, 8, 8)
    assert data.train.targets.dtype == torch.int64
    assert len(data.val) == 0
    assert data.val.inputs.shape == (0, 8, 8)
    assert len(data.test) == 5


def test_missing_test_file_is_named(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path, "train", inputs=np.zeros((3, 2)), targets=np.zeros(3))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"missing test\.npz"):
        load_device_data(tmp_path)


def test_missing_directory_is_a_value_error(tmp_path: Path) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="does not exist"):
        load_device_data(tmp_path / "nowhere")


def test_missing_array_is_named(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    _write(directory, "test", inputs=np.zeros((3, 8, 8)), labels=np.zeros(3))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"test\.npz lacks array\(s\) targets"):
        load_device_data(directory)


def test_mismatched_lengths_are_rejected(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    _write(directory, "train", inputs=np.zeros((4, 8, 8)), targets=np.zeros(5, np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match="inputs have 4 samples but targets have 5"):
        load_device_data(directory)


def test_mismatched_sample_shapes_across_splits_are_rejected(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    _write(directory, "val", inputs=np.zeros((2, 64)), targets=np.zeros(2, np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"val\.npz inputs have per-sample shape \(64,\)"):
        load_device_data(directory)


def test_object_arrays_are_refused_without_unpickling(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = [1, 2], [3]
    _write(directory, "train", inputs=ragged, targets=np.zeros(2, np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match="no pickle"):
        load_device_data(directory)


def test_corrupt_archive_is_a_value_error(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    (directory / "test.npz").write_bytes(b"PK\x03\x04 definitely not a zip archive")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"cannot read .*test\.npz"):
        load_device_data(directory)


def test_empty_train_split_is_rejected(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    _write(directory, "train", inputs=np.zeros((0, 8, 8)), targets=np.zeros(0, np.int64))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"train\.npz .* holds no samples"):
        load_device_data(directory)


def test_unsupported_dtype_is_rejected(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    _write(directory, "test", inputs=np.zeros((2, 8, 8)), targets=np.array(["a", "b"]))

    # Execute / Assert
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_device_data(directory)


def test_saved_files_hold_plain_arrays(tmp_path: Path) -> None:
    # Prepare
    data = DeviceData(
        device_index=0,
        train=Split(torch.ones(3, 2), torch.tensor([0, 1, 1])),
        val=Split(torch.ones(0, 2), torch.zeros(0, dtype=torch.int64)),
        test=Split(torch.zeros(1, 2), torch.tensor([1])),
    )

    # Execute
    save_device_data(data, tmp_path)

    # Assert
    with np.load(tmp_path / "train.npz", allow_pickle=False) as archive:
        assert sorted(archive.files) == ["inputs", "targets"]
        assert archive["inputs"].dtype == np.float32
        assert archive["targets"].dtype == np.int64


def test_single_array_file_is_not_an_archive(tmp_path: Path) -> None:
    # Prepare
    directory = _classification_dir(tmp_path)
    with (directory / "test.npz").open("wb") as stream:
        np.save(stream, np.zeros((3, 8, 8)))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"not a \.npz archive"):
        load_device_data(directory)
