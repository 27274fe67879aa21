"""Export metadata: every key round-trips through the file, and the shared hash is stable."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from export import ExportError, ExportProvenance, export_model, read_metadata
from export.metadata import package_version, shared_parameters_hash
from pfl_tasks.base import DeviceData, PartitionSpec, Task
from pfl_tasks.registry import task_fingerprint


def test_metadata_round_trips_through_the_file(
    tmp_path: Path, digits: Task, digits_device: DeviceData, provenance: ExportProvenance
) -> None:
    # Prepare: the shared part is everything but the personal output layer
    model = digits.build_model(5)
    shared = {k: v for k, v in model.state_dict().items() if not k.startswith("output.")}
    path = tmp_path / "model.onnx"

    # Execute
    result = export_model(
        model, digits, path, provenance=provenance, shared=shared, heldout=digits_device.test
    )
    stored = read_metadata(path)

    # Assert
    assert stored == result.metadata
    assert stored == {
        "pfl.metadata_version": "1",
        "pfl.algorithm": "fedavg",
        "pfl.round": "7",
        "pfl.task": "digits",
        "pfl.device_id": "kitchen-pi",
        "pfl.metric_name": "accuracy",
        "pfl.personalized_metric": "0.91",
        "pfl.global_metric": "0.84",
        "pfl.chosen_model": "personalized",
        "pfl.shared_sha256": shared_parameters_hash(shared),
        "pfl.architecture_fingerprint": task_fingerprint(digits, model),
        "pfl.version": package_version(),
        "pfl.quantization": "none",
        "pfl.input_preprocessing": "pixels / 16: the 0-16 grey levels scaled to [0, 1]",
    }
    assert float(stored["pfl.personalized_metric"]) == provenance.personalized_metric


def test_nan_scores_are_stored_as_nan(
    tmp_path: Path, digits: Task, digits_device: DeviceData
) -> None:
    provenance = ExportProvenance(
        algorithm="fedalt",
        round_id=0,
        device_id="d",
        chosen="global",
        personalized_metric=float("nan"),
        global_metric=0.5,
    )
    path = tmp_path / "m.onnx"
    export_model(
        digits.build_model(0),
        digits,
        path,
        provenance=provenance,
        shared={},
        heldout=digits_device.test,
    )
    stored = read_metadata(path)
    assert stored["pfl.personalized_metric"] == "nan"
    assert stored["pfl.chosen_model"] == "global"


def _tensors() -> OrderedDict[str, torch.Tensor]:
    return OrderedDict(
        a=torch.arange(6, dtype=torch.float32).reshape(2, 3),
        b=torch.tensor([1, 2], dtype=torch.int64),
    )


def test_shared_hash_ignores_order_but_not_names_dtypes_shapes_or_values() -> None:
    base = shared_parameters_hash(_tensors())
    reordered = OrderedDict(reversed(list(_tensors().items())))
    assert shared_parameters_hash(reordered) == base
    assert shared_parameters_hash({"c": _tensors()["a"], "b": _tensors()["b"]}) != base
    assert shared_parameters_hash({**_tensors(), "a": _tensors()["a"].double()}) != base
    assert shared_parameters_hash({**_tensors(), "a": _tensors()["a"].reshape(3, 2)}) != base
    nudged = _tensors()["a"].clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(100.0))
    assert shared_parameters_hash({**_tensors(), "a": nudged}) != base
    # non-contiguous views hash by value, the same as their contiguous copy
    transposed = _tensors()["a"].t().contiguous().t()
    assert shared_parameters_hash({**_tensors(), "a": transposed}) == base
    # the tensors' bytes and layout are framed, so moving one element across names differs
    split_a = {"a": torch.zeros(1), "b": torch.zeros(2)}
    split_b = {"a": torch.zeros(2), "b": torch.zeros(1)}
    assert shared_parameters_hash(split_a) != shared_parameters_hash(split_b)


def test_shared_hash_is_a_known_constant() -> None:
    # Pinned so a change to the hashing scheme is a deliberate, versioned decision.
    assert shared_parameters_hash(_tensors()) == (
        "33bc9b1095ac5d68e5f28b6637f6f37dd834e41b13f1f2553f8426058ee159cf"
    )


@pytest.mark.parametrize("content", [b"", b"not an onnx file at all \x00\xff"])
def test_read_metadata_refuses_a_file_that_is_not_onnx(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.onnx"
    path.write_bytes(content)
    with pytest.raises(ExportError, match="not an ONNX model"):
        read_metadata(path)


def test_read_metadata_of_a_missing_file_is_an_export_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="cannot read"):
        read_metadata(tmp_path / "absent.onnx")


def test_provenance_rejects_an_unknown_choice() -> None:
    with pytest.raises(ValueError, match="personalized, global"):
        ExportProvenance(
            algorithm="fedavg",
            round_id=1,
            device_id="d",
            chosen="local",  # type: ignore[arg-type]
            personalized_metric=0.0,
            global_metric=0.0,
        )


def test_a_task_without_declared_preprocessing_records_none(
    tmp_path: Path, provenance: ExportProvenance
) -> None:
    from pfl_tasks.registry import load_task

    sine = load_task("sine")
    model = sine.build_model(0)
    path = tmp_path / "sine.onnx"
    fleet = sine.make_fleet(2, PartitionSpec(), 0)
    export_model(model, sine, path, provenance=provenance, shared={}, heldout=fleet[0].test)
    stored = read_metadata(path)
    assert "pfl.input_preprocessing" not in stored
    assert stored["pfl.task"] == "sine"
