"""export_model: every built-in task round-trips through onnxruntime; bad exports fail loudly."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import export.onnx_export as onnx_export
from export import (
    DEFAULT_TOLERANCE,
    OPSET,
    ExportError,
    ExportProvenance,
    ExportResult,
    export_model,
    quantized_path,
    read_metadata,
)
from pfl_tasks.base import DeviceData, PartitionSpec, Task
from pfl_tasks.registry import load_task

Fit = Callable[..., nn.Module]
ExportDigits = Callable[..., ExportResult]

BUILTIN_CASES = [
    pytest.param("digits", {}, id="digits"),
    pytest.param("synthetic", {"model": "mlp"}, id="synthetic-mlp"),
    pytest.param("synthetic", {"model": "mclr"}, id="synthetic-mclr"),
    pytest.param("gaussian", {}, id="gaussian"),
    pytest.param("sine", {}, id="sine"),
]


def _fresh(task_inputs: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, *task_inputs.shape[1:], generator=generator)


@pytest.mark.parametrize(("name", "options"), BUILTIN_CASES)
def test_every_builtin_task_exports_and_matches_pytorch_at_batch_1_and_17(
    tmp_path: Path, provenance: ExportProvenance, name: str, options: dict[str, object]
) -> None:
    # Prepare
    task = load_task(name, options)
    device = task.make_fleet(3, PartitionSpec(scheme="iid"), seed=1)[0]
    model = task.build_model(seed=3)
    path = tmp_path / f"{name}.onnx"

    # Execute
    result = export_model(
        model,
        task,
        path,
        provenance=provenance,
        shared=dict(model.state_dict()),
        heldout=device.test,
    )

    # Assert: an independent session from the file, on inputs export never saw
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(task.input_names)
    assert [o.name for o in session.get_outputs()] == list(task.output_names)
    model.eval()
    for rows in (1, 17):
        inputs = _fresh(device.test.inputs, rows, seed=100 + rows)
        (onnx_out,) = session.run(None, {task.input_names[0]: inputs.numpy()})
        with torch.no_grad():
            torch_out = model(inputs).numpy()
        assert onnx_out.shape == torch_out.shape
        assert onnx_out.shape[0] == rows
        assert np.abs(onnx_out - torch_out).max() <= DEFAULT_TOLERANCE
    proto = onnx.load(str(path))
    assert {op.domain: op.version for op in proto.opset_import}[""] == OPSET
    batch_dim = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param == "batch"
    assert result.parity_max_abs_diff <= DEFAULT_TOLERANCE
    assert result.size_bytes == path.stat().st_size
    assert result.metric == pytest.approx(result.torch_metric, abs=1e-6)
    assert result.quantized is None


def _flip_largest_initializer(data: bytes) -> bytes:
    proto = onnx.load_from_string(data)
    initializer = max(proto.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    values = onnx.numpy_helper.to_array(initializer)
    initializer.CopyFrom(onnx.numpy_helper.from_array(-values - 0.5, initializer.name))
    serialized: bytes = proto.SerializeToString()
    return serialized


def _export_after(monkeypatch: pytest.MonkeyPatch, change: Callable[[nn.Module], None]) -> None:
    """Make the exporter change its model first: the file no longer matches the intended one."""
    real = onnx_export.to_onnx_bytes

    def changed(model: nn.Module, *args: Any, **kwargs: Any) -> bytes:
        with torch.no_grad():
            change(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx_export, "to_onnx_bytes", changed)


def _nudge_output_bias(amount: float) -> Callable[[nn.Module], None]:
    def nudge(model: nn.Module) -> None:
        bias = model.get_submodule("output").get_parameter("bias")
        bias.add_(amount)

    return nudge


def test_parity_check_rejects_an_export_whose_weights_were_corrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_digits: ExportDigits
) -> None:
    # Prepare: the exporter hands back a file whose largest initializer is flipped
    real = onnx_export.to_onnx_bytes
    monkeypatch.setattr(
        onnx_export,
        "to_onnx_bytes",
        lambda *args, **kw: _flip_largest_initializer(real(*args, **kw)),
    )

    # Execute
    with pytest.raises(ExportError) as caught:
        export_digits()

    # Assert
    message = str(caught.value)
    assert "max abs difference" in message
    assert f"tolerance {DEFAULT_TOLERANCE:.3g}" in message
    assert "device=kitchen-pi" in message
    assert list(tmp_path.iterdir()) == []


def test_parity_compares_against_the_model_as_passed_not_as_exported(
    monkeypatch: pytest.MonkeyPatch, export_digits: ExportDigits
) -> None:
    # Prepare: the model changes between "intended" and "exported" (a stale or racing state
    # load); a check that re-ran the changed model would wrongly pass.
    _export_after(monkeypatch, _nudge_output_bias(0.01))

    # Execute / Assert
    with pytest.raises(ExportError, match=r"max abs difference 0\.01 "):
        export_digits()


def test_tolerance_is_configurable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_digits: ExportDigits
) -> None:
    # Prepare: a drift of exactly 1e-3 in every logit
    _export_after(monkeypatch, _nudge_output_bias(1e-3))

    # Execute / Assert
    with pytest.raises(ExportError):
        export_digits(path=tmp_path / "strict.onnx")
    result = export_digits(path=tmp_path / "loose.onnx", tolerance=1e-2)
    assert result.parity_max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loose.onnx"]


def test_a_model_whose_forward_fails_on_the_sample_input_gets_a_clear_error(
    tmp_path: Path, export_digits: ExportDigits
) -> None:
    # Prepare: a 60-feature synthetic model assembled for the 64-pixel digits task
    wrong = load_task("synthetic").build_model(0)

    # Execute / Assert
    with pytest.raises(ExportError, match=r"forward pass fails on the 'digits' task's sample"):
        export_digits(wrong)
    assert list(tmp_path.iterdir()) == []


def test_a_model_returning_nan_is_refused(digits: Task, export_digits: ExportDigits) -> None:
    model = digits.build_model(0)
    with torch.no_grad():
        model.get_submodule("output").get_parameter("bias").fill_(float("nan"))
    with pytest.raises(ExportError, match="NaN or Inf"):
        export_digits(model)


def _fail_with(error: OSError) -> Callable[..., None]:
    def broken(*args: object, **kwargs: object) -> None:
        raise error

    return broken


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_write_leaves_the_previous_file_and_no_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_digits: ExportDigits, failing: str
) -> None:
    # Prepare: a previous export is in place; the disk fails mid-write
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous export")
    monkeypatch.setattr(f"protocols.atomic.os.{failing}", _fail_with(OSError(28, "disk full")))

    # Execute
    with pytest.raises(ExportError, match="cannot write the exported model"):
        export_digits()

    # Assert
    monkeypatch.undo()
    assert path.read_bytes() == b"previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_a_failed_first_write_leaves_no_file_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_digits: ExportDigits
) -> None:
    monkeypatch.setattr("protocols.atomic.os.fsync", _fail_with(OSError(5, "I/O error")))
    with pytest.raises(ExportError):
        export_digits()
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_int8_quantization_writes_a_smaller_file_and_reports_the_metric_change(
    tmp_path: Path, fit: Fit, digits: Task, digits_device: DeviceData, export_digits: ExportDigits
) -> None:
    # Prepare: a trained model, so the metric change means something
    model = fit(digits.build_model(0), digits, digits_device.train)

    # Execute
    result = export_digits(model, shared=dict(model.state_dict()), quantize="int8")

    # Assert
    quantized = result.quantized
    assert quantized is not None
    assert quantized.path == quantized_path(result.path) == tmp_path / "model.int8.onnx"
    assert quantized.size_bytes == quantized.path.stat().st_size
    assert quantized.size_bytes < 0.6 * result.size_bytes
    assert result.metric > 0.8  # trained, so a change would be visible
    # the reported quantized metric is the int8 file's own, scored here independently
    session = ort.InferenceSession(str(quantized.path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"pixels": digits_device.test.inputs.numpy()})
    accuracy = float((logits.argmax(axis=1) == digits_device.test.targets.numpy()).mean())
    assert quantized.metric == pytest.approx(accuracy)
    assert result.quantized_metric == quantized.metric
    assert quantized.metric_change == pytest.approx(quantized.metric - result.metric)
    assert quantized.parity_max_abs_diff > 0.0  # int8 really changed the arithmetic
    assert quantized.within_tolerance == (
        quantized.parity_max_abs_diff <= quantized.parity_tolerance
    )
    metadata = read_metadata(quantized.path)
    assert metadata["pfl.quantization"] == "int8"
    assert metadata["pfl.source_sha256"] == result.sha256
    assert metadata["pfl.shared_sha256"] == result.metadata["pfl.shared_sha256"]


def test_int8_parity_beyond_its_tolerance_is_reported_not_raised(
    caplog: pytest.LogCaptureFixture, export_digits: ExportDigits
) -> None:
    with caplog.at_level(logging.WARNING, logger="export.onnx_export"):
        result = export_digits(quantize="int8", quantized_tolerance=0.0)
    assert result.quantized is not None
    assert not result.quantized.within_tolerance
    assert result.quantized.path.exists()
    assert "int8 model differs from PyTorch" in caplog.text


def test_unknown_quantization_names_the_valid_choices(export_digits: ExportDigits) -> None:
    with pytest.raises(ValueError, match="valid choices: None, int8"):
        export_digits(quantize="int4")


def test_export_leaves_the_callers_model_untouched(
    digits: Task, export_digits: ExportDigits
) -> None:
    model = digits.build_model(0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_digits(model)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_result_serializes_for_the_export_report(
    tmp_path: Path, export_digits: ExportDigits
) -> None:
    report = export_digits(quantize="int8").as_dict()
    assert json.loads(json.dumps(report)) == report
    assert report["path"] == os.fspath(tmp_path / "model.onnx")
    assert report["chosen"] == "personalized"
    assert isinstance(report["quantized"], dict)
    assert report["quantized"]["path"] == os.fspath(tmp_path / "model.int8.onnx")


def test_a_file_onnxruntime_cannot_load_is_an_export_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_digits: ExportDigits
) -> None:
    # Prepare: the exporter produces a graph that references an initializer it dropped
    real = onnx_export.to_onnx_bytes

    def drop_initializers(*args: Any, **kwargs: Any) -> bytes:
        proto = onnx.load_from_string(real(*args, **kwargs))
        del proto.graph.initializer[:]
        serialized: bytes = proto.SerializeToString()
        return serialized

    monkeypatch.setattr(onnx_export, "to_onnx_bytes", drop_initializers)

    # Execute / Assert
    with pytest.raises(ExportError, match="onnxruntime cannot load"):
        export_digits()
    assert list(tmp_path.iterdir()) == []
