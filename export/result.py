"""What an export produced: the files written and how they behave, for the export report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .metadata import Chosen


@dataclass(frozen=True)
class QuantizedExport:
    """The int8 file written beside the fp32 one, and what quantization cost on held-out data.

    Its parity is reported, never enforced: int8 rounding moves outputs by far more than fp32
    noise, and whether that is acceptable is the deployer's call, made from `metric_change`.
    """

    path: Path
    size_bytes: int
    sha256: str
    parity_max_abs_diff: float
    parity_tolerance: float
    within_tolerance: bool
    metric: float
    metric_change: float


@dataclass(frozen=True)
class ExportResult:
    """What was written and how it behaves, for the device's export report.

    `metric` is the exported file's own held-out score, computed by onnxruntime, and
    `torch_metric` the same split scored by the PyTorch model before export.
    """

    path: Path
    size_bytes: int
    sha256: str
    opset: int
    parity_max_abs_diff: float
    tolerance: float
    metric_name: str
    metric: float
    torch_metric: float
    chosen: Chosen
    metadata: dict[str, str]
    quantized: QuantizedExport | None = None

    @property
    def quantized_metric(self) -> float | None:
        """The int8 file's held-out metric, when one was written."""
        return None if self.quantized is None else self.quantized.metric

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready view (paths as strings) for logs and the export-report message."""
        return {key: _jsonable(value) for key, value in asdict(self).items()}


def quantized_path(path: Path) -> Path:
    """Where the int8 file goes: `model.onnx` -> `model.int8.onnx`."""
    return path.with_name(f"{path.stem}.int8{path.suffix or '.onnx'}")


def _jsonable(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
