"""Dynamic int8 quantization of an exported fp32 ONNX model with onnxruntime's tooling."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Final, Literal

import onnx
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process

from .errors import ExportError

logger = logging.getLogger(__name__)

Quantization = Literal["int8"]
QUANTIZATIONS: Final = ("int8",)


def check_quantization(quantize: object) -> Quantization | None:
    """Validate the `quantize` option early, before any work is done.

    Raises:
        ValueError: for anything but None or "int8", naming the valid choices.
    """
    if quantize is None:
        return None
    if quantize == "int8":
        return "int8"
    msg = f"unknown quantization {quantize!r}; valid choices: None, {', '.join(QUANTIZATIONS)}"
    raise ValueError(msg)


def quantize_int8(model_bytes: bytes) -> bytes:
    """The model with int8 weights and dynamically quantized activations (MatMul/Gemm/Conv).

    Dynamic quantization needs no calibration data, which a device may not want to spend, and
    shrinks weights about 4x. onnxruntime's recommended pre-processing (shape inference and
    graph optimization) runs first. Both tools only work on files, so this round-trips through
    a private temporary directory.

    Raises:
        ExportError: onnxruntime's quantizer rejected the model.
    """
    with tempfile.TemporaryDirectory(prefix="pfl-quantize-") as directory:
        source = Path(directory) / "fp32.onnx"
        prepared = Path(directory) / "prepared.onnx"
        target = Path(directory) / "int8.onnx"
        source.write_bytes(model_bytes)
        try:
            quant_pre_process(str(source), str(prepared))
            quantize_dynamic(str(prepared), str(target), weight_type=QuantType.QInt8)
            quantized = onnx.load(str(target))
        except Exception as error:  # the quantizer raises many unrelated exception types
            msg = f"int8 dynamic quantization failed: {type(error).__name__}: {error}"
            raise ExportError(msg) from error
    logger.debug("quantized %d bytes to %d", len(model_bytes), quantized.ByteSize())
    return bytes(quantized.SerializeToString())
