"""Personalized model to ONNX, with an onnxruntime parity check and provenance metadata.

The flow on a device: `choose_model` (the personalization guard) picks the personalized or the
global model on the validation split, `export_model` writes and verifies the file, and
`read_metadata` reads its provenance back. docs/export.md explains each step.
"""

from __future__ import annotations

from .errors import ExportError
from .guard import choose_model
from .metadata import (
    ExportProvenance,
    read_metadata,
    shared_parameters_hash,
)
from .onnx_export import (
    DEFAULT_QUANTIZED_TOLERANCE,
    DEFAULT_TOLERANCE,
    OPSET,
    export_model,
)
from .result import ExportResult, QuantizedExport, quantized_path

__all__ = [
    "DEFAULT_QUANTIZED_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "OPSET",
    "ExportError",
    "ExportProvenance",
    "ExportResult",
    "QuantizedExport",
    "choose_model",
    "export_model",
    "quantized_path",
    "read_metadata",
    "shared_parameters_hash",
]
