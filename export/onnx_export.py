"""A personalized model to a verified ONNX file: export, parity check, metadata, atomic write."""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import math
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import onnx
import torch
from torch import nn

from pfl_tasks.base import Split, Task
from protocols.atomic import write_atomically
from protocols.errors import StateError

from .errors import ExportError
from .fold import fold_batch_norms
from .metadata import (
    KEY_CALIBRATION_SAMPLES,
    KEY_FOLDED_BATCH_NORMS,
    KEY_QUANTIZATION,
    KEY_SOURCE_SHA256,
    ExportProvenance,
    build_metadata,
    embed_metadata,
)
from .parity import (
    OnnxPredictor,
    Outputs,
    as_outputs,
    check_parity,
    make_session,
    max_abs_difference,
    metric_of,
    parity_batches,
    record_outputs,
    torch_predictor,
)
from .quantize import (
    CALIBRATION_SAMPLES,
    Quantization,
    check_quantization,
    quantize_int8,
    quantize_int8_static,
)
from .result import ExportResult, QuantizedExport, quantized_path

logger = logging.getLogger(__name__)

OPSET: Final = 17
DEFAULT_TOLERANCE: Final = 1e-4
DEFAULT_QUANTIZED_TOLERANCE: Final = 0.25
BATCH_AXIS: Final = "batch"
TRACE_ROWS: Final = 2


def check_forward(model: nn.Module, task: Task, sample: torch.Tensor) -> Outputs:
    """Run the model once on the task's sample input, so a broken model fails with a clear error.

    A model assembled from mismatched state usually fails here (a shape error deep in a layer);
    the message names the task and the input shape instead of leaving a torch.onnx traceback.

    Raises:
        ExportError: the forward pass raises, returns the wrong number of outputs, or returns
            outputs whose batch size or values (NaN/Inf) are wrong.
    """
    try:
        with torch.no_grad():
            outputs = as_outputs(model(sample))
    except ExportError:
        raise
    except Exception as error:  # any failure of user code is an export failure
        msg = (
            f"the model's forward pass fails on the {task.name!r} task's sample input of shape "
            f"{tuple(sample.shape)}: {type(error).__name__}: {error}"
        )
        raise ExportError(msg) from error
    if len(outputs) != len(task.output_names):
        msg = (
            f"the model returns {len(outputs)} outputs but task {task.name!r} names "
            f"{len(task.output_names)}: {', '.join(task.output_names)}"
        )
        raise ExportError(msg)
    for name, output in zip(task.output_names, outputs, strict=True):
        if output.dim() == 0 or output.shape[0] != sample.shape[0]:
            msg = (
                f"output {name!r} has shape {tuple(output.shape)}; its first axis must be the "
                f"batch ({sample.shape[0]}) for a dynamic batch export"
            )
            raise ExportError(msg)
        if output.is_floating_point() and not bool(torch.isfinite(output).all()):
            msg = f"output {name!r} holds NaN or Inf on the sample input"
            raise ExportError(msg)
    return outputs


def to_onnx_bytes(model: nn.Module, task: Task, sample: torch.Tensor, opset: int = OPSET) -> bytes:
    """Serialize the model with torch.onnx's TorchScript exporter and a dynamic batch axis.

    The TorchScript path (dynamo=False) needs no onnxscript, exists in every torch >= 2.1 a
    device may run, and matches PyTorch to ~1e-7 on the built-in models; its deprecation
    warning is silenced here because the choice is deliberate (docs/export.md). It writes to a
    private temporary file, the one destination every torch version's signature accepts.

    Raises:
        ExportError: torch.onnx cannot export the model, or the result fails onnx's checker.
    """
    names = (*task.input_names, *task.output_names)
    options: dict[str, Any] = {}
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        options["dynamo"] = False
    try:
        with tempfile.TemporaryDirectory(prefix="pfl-export-") as directory:
            target = Path(directory) / "model.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                torch.onnx.export(
                    model,
                    (sample,),
                    str(target),
                    opset_version=opset,
                    input_names=list(task.input_names),
                    output_names=list(task.output_names),
                    dynamic_axes={name: {0: BATCH_AXIS} for name in names},
                    do_constant_folding=True,
                    **options,
                )
            data = target.read_bytes()
        onnx.checker.check_model(onnx.load_from_string(data))
    except Exception as error:  # torch.onnx raises many types; all mean "cannot export"
        msg = f"torch.onnx cannot export the {task.name!r} model: {type(error).__name__}: {error}"
        raise ExportError(msg) from error
    return data


def export_model(
    model: nn.Module,
    task: Task,
    path: Path | str,
    *,
    provenance: ExportProvenance,
    shared: Mapping[str, torch.Tensor],
    heldout: Split,
    tolerance: float = DEFAULT_TOLERANCE,
    quantize: Quantization | None = None,
    quantized_tolerance: float = DEFAULT_QUANTIZED_TOLERANCE,
    opset: int = OPSET,
    seed: int = 0,
    calibration: torch.Tensor | None = None,
) -> ExportResult:
    """Export a device's model to ONNX and prove the file computes what the model computes.

    Reference outputs are recorded from a private copy of `model` before export, on the
    held-out inputs and on fresh batches of 1 and 17 rows; the file, exported from a copy with
    each BatchNorm folded into the layer before it (`export.fold`), is then run in onnxruntime
    and compared. Nothing is written unless the fp32 comparison passes; files are written
    atomically, so `path` holds the previous file or the new one, never a partial one.

    Args:
        model: The assembled module to deploy (shared and personal state loaded, or a module
            implementing a mixture's prediction rule), typically from `choose_model`.
        task: Supplies input/output names, the metric and the architecture fingerprint.
        path: Destination of the fp32 file; an int8 file goes to `quantized_path(path)`.
        provenance: Algorithm, round, device and the guard's decision, for the metadata.
        shared: The shared parameters this model was assembled with, hashed into the metadata.
        heldout: The device's held-out split: parity inputs and the reported metrics.
        tolerance: Largest max abs difference accepted between onnxruntime and PyTorch.
        quantize: "int8" to also write a dynamically quantized file; "int8-static" for one
            whose activation ranges `calibration` fixed.
        quantized_tolerance: Reported bound for the int8 file's difference (never enforced).
        opset: ONNX opset to export with.
        seed: Seed of the fresh parity inputs.
        calibration: The device's own inputs (its training split), for "int8-static".

    Raises:
        ExportError: the model's forward fails, torch.onnx fails, the fp32 parity difference
            exceeds `tolerance`, quantization fails, or a file cannot be written.
        ValueError: an option is invalid (tolerance, quantize, empty held-out split, no
            calibration samples for "int8-static").
    """
    path = Path(path)
    quantize = check_quantization(quantize)
    _check_options(task, heldout, tolerance, quantized_tolerance)
    device_id, round_id = provenance.device_id, provenance.round_id
    intended = _private_copy(model)
    sample = _trace_sample(heldout.inputs)
    check_forward(intended, task, sample)
    batches = parity_batches(heldout.inputs, seed)
    reference = torch_predictor(intended)
    expected = record_outputs(reference, batches)  # before export can touch the model
    torch_metric = metric_of(reference, task, heldout)
    metadata = build_metadata(provenance, task, intended, shared)
    inference = _private_copy(intended)
    folded = fold_batch_norms(inference)
    if folded:
        metadata[KEY_FOLDED_BATCH_NORMS] = str(folded)
    data = embed_metadata(to_onnx_bytes(inference, task, sample, opset), metadata)
    predictor = OnnxPredictor(make_session(data))
    difference = check_parity(
        expected, predictor, batches, tolerance, device_id=device_id, round_id=round_id
    )
    metric = metric_of(predictor, task, heldout)
    sha256 = hashlib.sha256(data).hexdigest()
    quantized_data, quantized = None, None
    if quantize is not None:
        quantized_data = _quantized(data, quantize, task, calibration, metadata, sha256)
        quantized = _measure_quantized(
            quantized_data,
            quantized_path(path),
            expected,
            batches,
            task,
            heldout,
            quantized_tolerance,
            metric,
        )
    _write(path, data, device_id=device_id, round_id=round_id)
    if quantized is not None and quantized_data is not None:
        _write(quantized.path, quantized_data, device_id=device_id, round_id=round_id)
    logger.info(
        "exported %s model to %s (%d bytes, max abs diff %.3g, held-out %s %.4g)",
        provenance.chosen,
        path,
        len(data),
        difference,
        task.metric_name,
        metric,
    )
    return ExportResult(
        path=path,
        size_bytes=len(data),
        sha256=sha256,
        opset=opset,
        parity_max_abs_diff=difference,
        tolerance=tolerance,
        metric_name=task.metric_name,
        metric=metric,
        torch_metric=torch_metric,
        chosen=provenance.chosen,
        metadata=metadata,
        quantized=quantized,
    )


def _quantized(
    data: bytes,
    quantize: Quantization,
    task: Task,
    calibration: torch.Tensor | None,
    metadata: Mapping[str, str],
    sha256: str,
) -> bytes:
    """The int8 file's bytes, its metadata saying how it was quantized and from which file."""
    extra = {KEY_QUANTIZATION: quantize, KEY_SOURCE_SHA256: sha256}
    if quantize == "int8":
        return embed_metadata(quantize_int8(data), {**metadata, **extra})
    if calibration is None:
        msg = "int8-static quantization calibrates on the device's own inputs: none were given"
        raise ValueError(msg)
    quantized = quantize_int8_static(data, task.input_names[0], calibration)
    samples = str(min(len(calibration), CALIBRATION_SAMPLES))
    return embed_metadata(quantized, {**metadata, **extra, KEY_CALIBRATION_SAMPLES: samples})


def _measure_quantized(
    data: bytes,
    path: Path,
    expected: list[Outputs],
    batches: list[torch.Tensor],
    task: Task,
    heldout: Split,
    tolerance: float,
    fp32_metric: float,
) -> QuantizedExport:
    predictor = OnnxPredictor(make_session(data))
    difference = max_abs_difference(expected, predictor, batches)
    metric = metric_of(predictor, task, heldout)
    within = difference <= tolerance
    if not within:
        logger.warning(
            "int8 model differs from PyTorch by up to %.3g (reported bound %.3g); held-out %s "
            "changes by %+.4g",
            difference,
            tolerance,
            task.metric_name,
            metric - fp32_metric,
        )
    return QuantizedExport(
        path=path,
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        parity_max_abs_diff=difference,
        parity_tolerance=tolerance,
        within_tolerance=within,
        metric=metric,
        metric_change=metric - fp32_metric,
    )


def _check_options(
    task: Task, heldout: Split, tolerance: float, quantized_tolerance: float
) -> None:
    for name, value in (("tolerance", tolerance), ("quantized_tolerance", quantized_tolerance)):
        if not (math.isfinite(value) and value >= 0.0):
            msg = f"{name} must be a finite number >= 0, got {value!r}"
            raise ValueError(msg)
    if len(heldout) == 0:
        msg = "the held-out split is empty: export needs inputs to verify the file against"
        raise ValueError(msg)
    if len(task.input_names) != 1:
        msg = (
            f"task {task.name!r} names {len(task.input_names)} inputs; export supports models "
            f"with exactly one input tensor"
        )
        raise ExportError(msg)


def _private_copy(model: nn.Module) -> nn.Module:
    """A copy in eval mode, so export neither changes the caller's model nor sees it change."""
    try:
        return copy.deepcopy(model).eval()
    except Exception as error:  # deepcopy failures surface as many types
        msg = f"cannot copy the model for export: {type(error).__name__}: {error}"
        raise ExportError(msg) from error


def _trace_sample(inputs: torch.Tensor) -> torch.Tensor:
    """Two held-out rows (one repeated if that is all there is) to trace the export with.

    Tracing with more than one row keeps a batch of 1 from being baked in as a constant;
    parity then runs at 1 and 17 rows, sizes the trace never saw.
    """
    rows = inputs[:TRACE_ROWS]
    return rows if rows.shape[0] == TRACE_ROWS else rows.repeat(TRACE_ROWS, *[1] * (rows.dim() - 1))


def _write(path: Path, data: bytes, *, device_id: str, round_id: int) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)
    except (OSError, StateError) as error:
        msg = f"cannot write the exported model: {error}"
        raise ExportError(msg, device_id=device_id, round_id=round_id) from error
