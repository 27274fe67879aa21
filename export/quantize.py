"""int8 quantization of an exported fp32 ONNX model with onnxruntime's tooling.

Dynamic (weights int8, activations quantized per call) needs no data; static (activations'
ranges calibrated once) needs samples, and a device calibrates on its own training inputs,
which never leave it: the calibrated file is quantized for the data it will see.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

import numpy as np
import onnx
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from .errors import ExportError

logger = logging.getLogger(__name__)

Quantization = Literal["int8", "int8-static"]
QUANTIZATIONS: Final = ("int8", "int8-static")
CALIBRATION_BATCH: Final = 32
CALIBRATION_SAMPLES: Final = 512
"""At most this many of the device's samples calibrate (the first ones: its data, any order)."""


def check_quantization(quantize: object) -> Quantization | None:
    """Validate the `quantize` option early, before any work is done.

    Raises:
        ValueError: for anything but None, "int8" or "int8-static", naming the valid choices.
    """
    if quantize is None:
        return None
    if quantize == "int8":
        return "int8"
    if quantize == "int8-static":
        return "int8-static"
    msg = f"unknown quantization {quantize!r}; valid choices: None, {', '.join(QUANTIZATIONS)}"
    raise ValueError(msg)


def quantize_int8(model_bytes: bytes) -> bytes:
    """The model with int8 weights and dynamically quantized activations (MatMul/Gemm/Conv).

    Dynamic quantization needs no calibration data, which a device may not want to spend, and
    shrinks weights about 4x.

    Raises:
        ExportError: onnxruntime's quantizer rejected the model.
    """

    def dynamic(prepared: str, target: str) -> None:
        quantize_dynamic(prepared, target, weight_type=QuantType.QInt8)

    return _through_files(model_bytes, dynamic, "dynamic")


class DeviceSamples(CalibrationDataReader):  # type: ignore[misc]
    """The device's own inputs in batches, as onnxruntime's calibrator reads them."""

    def __init__(self, input_name: str, inputs: torch.Tensor) -> None:
        rows = inputs[:CALIBRATION_SAMPLES].detach().to(torch.float32).numpy()
        self._batches = iter(
            [
                {input_name: np.ascontiguousarray(rows[start : start + CALIBRATION_BATCH])}
                for start in range(0, len(rows), CALIBRATION_BATCH)
            ]
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch, None when all were read."""
        return next(self._batches, None)


def quantize_int8_static(model_bytes: bytes, input_name: str, calibration: torch.Tensor) -> bytes:
    """The model with int8 weights and activations whose ranges `calibration` fixed (QDQ).

    Min-max calibration over at most CALIBRATION_SAMPLES of the device's own inputs; weights
    per channel (convolutions keep their accuracy that way). Layers the quantizer has no int8
    kernel for (e.g. GRU) stay fp32 between dequantize and quantize nodes.

    Raises:
        ValueError: no calibration samples.
        ExportError: onnxruntime's quantizer rejected the model.
    """
    if len(calibration) == 0:
        msg = "static int8 quantization needs calibration samples: the device has none"
        raise ValueError(msg)

    def static(prepared: str, target: str) -> None:
        quantize_static(
            prepared,
            target,
            DeviceSamples(input_name, calibration),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
        )

    return _through_files(model_bytes, static, "static")


def _through_files(model_bytes: bytes, quantize: Callable[[str, str], None], kind: str) -> bytes:
    """Run onnxruntime's pre-processing (shape inference, graph optimization), then `quantize`.

    Both tools only work on files, so this round-trips through a private temporary directory.

    Raises:
        ExportError: the pre-processing or the quantizer failed.
    """
    with tempfile.TemporaryDirectory(prefix="pfl-quantize-") as directory:
        source = Path(directory) / "fp32.onnx"
        prepared = Path(directory) / "prepared.onnx"
        target = Path(directory) / "int8.onnx"
        source.write_bytes(model_bytes)
        try:
            quant_pre_process(str(source), str(prepared))
            quantize(str(prepared), str(target))
            quantized = onnx.load(str(target))
        except Exception as error:  # the quantizer raises many unrelated exception types
            msg = f"int8 {kind} quantization failed: {type(error).__name__}: {error}"
            raise ExportError(msg) from error
    logger.debug("quantized (%s) %d bytes to %d", kind, len(model_bytes), quantized.ByteSize())
    return bytes(quantized.SerializeToString())
