"""Provenance of an exported model: what goes into the ONNX metadata_props and how to read it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import onnx
import torch
from google.protobuf.message import DecodeError
from torch import nn

from pfl_tasks.base import Task
from pfl_tasks.registry import task_fingerprint

from .errors import ExportError

Chosen = Literal["personalized", "global"]
CHOICES: Final = ("personalized", "global")

METADATA_VERSION: Final = "1"
SHARED_HASH_VERSION: Final = "pfl-edge/shared-sha256/1"

KEY_METADATA_VERSION: Final = "pfl.metadata_version"
KEY_ALGORITHM: Final = "pfl.algorithm"
KEY_ROUND: Final = "pfl.round"
KEY_TASK: Final = "pfl.task"
KEY_DEVICE_ID: Final = "pfl.device_id"
KEY_METRIC_NAME: Final = "pfl.metric_name"
KEY_PERSONALIZED_METRIC: Final = "pfl.personalized_metric"
KEY_GLOBAL_METRIC: Final = "pfl.global_metric"
KEY_CHOSEN: Final = "pfl.chosen_model"
KEY_SHARED_SHA256: Final = "pfl.shared_sha256"
KEY_ARCHITECTURE: Final = "pfl.architecture_fingerprint"
KEY_VERSION: Final = "pfl.version"
KEY_QUANTIZATION: Final = "pfl.quantization"
KEY_SOURCE_SHA256: Final = "pfl.source_sha256"
KEY_FOLDED_BATCH_NORMS: Final = "pfl.folded_batch_norms"
"""How many BatchNorm layers the file has folded into the layer before them (absent: none)."""
KEY_CALIBRATION_SAMPLES: Final = "pfl.calibration_samples"
"""How many of the device's own inputs calibrated a statically quantized file."""
KEY_INPUT_PREPROCESSING: Final = "pfl.input_preprocessing"
"""What a raw input needs before the model takes it, when the task declares it (optional
`input_preprocessing` text on the task): the scaling lives in the task's source otherwise."""

PACKAGE: Final = "pfl-edge"


@dataclass(frozen=True)
class ExportProvenance:
    """Who and what produced a model: the facts export cannot infer from the module itself.

    The two metrics are the guard's scores on the device's validation split (see
    `export.guard.choose_model`), recorded so a deployer can see what personalization bought.
    """

    algorithm: str
    round_id: int
    device_id: str
    chosen: Chosen
    personalized_metric: float
    global_metric: float

    def __post_init__(self) -> None:
        if self.chosen not in CHOICES:
            msg = f"chosen must be one of {', '.join(CHOICES)}, got {self.chosen!r}"
            raise ValueError(msg)
        if isinstance(self.round_id, bool) or self.round_id < 0:
            msg = f"round_id must be a non-negative integer, got {self.round_id!r}"
            raise ValueError(msg)


def package_version() -> str:
    """The installed pfl-edge version, or "unknown" when running from an uninstalled tree."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def shared_parameters_hash(shared: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 identifying the shared parameters a device exported with, independent of order.

    Each tensor contributes its name, dtype, shape and raw little-endian bytes, in sorted name
    order, so the same global model hashes the same on every device and in every process.
    """
    digest = hashlib.sha256(SHARED_HASH_VERSION.encode("utf-8"))
    for name in sorted(shared):
        tensor = shared[name].detach().cpu().contiguous()
        header = json.dumps([name, str(tensor.dtype), list(tensor.shape)], separators=(",", ":"))
        digest.update(len(header).to_bytes(8, "little"))
        digest.update(header.encode("utf-8"))
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return digest.hexdigest()


def build_metadata(
    provenance: ExportProvenance,
    task: Task,
    model: nn.Module,
    shared: Mapping[str, torch.Tensor],
) -> dict[str, str]:
    """Every metadata key of an fp32 export, as the strings ONNX metadata_props hold."""
    preprocessing = str(getattr(task, "input_preprocessing", "") or "")
    declared = {KEY_INPUT_PREPROCESSING: preprocessing} if preprocessing else {}
    return {
        KEY_METADATA_VERSION: METADATA_VERSION,
        KEY_ALGORITHM: provenance.algorithm,
        KEY_ROUND: str(provenance.round_id),
        KEY_TASK: task.name,
        KEY_DEVICE_ID: provenance.device_id,
        KEY_METRIC_NAME: task.metric_name,
        KEY_PERSONALIZED_METRIC: format_float(provenance.personalized_metric),
        KEY_GLOBAL_METRIC: format_float(provenance.global_metric),
        KEY_CHOSEN: provenance.chosen,
        KEY_SHARED_SHA256: shared_parameters_hash(shared),
        KEY_ARCHITECTURE: task_fingerprint(task, model),
        KEY_VERSION: package_version(),
        KEY_QUANTIZATION: "none",
        **declared,
    }


def format_float(value: float) -> str:
    """A float as text that parses back exactly (repr), with "nan" for a missing score."""
    return "nan" if math.isnan(value) else repr(float(value))


def embed_metadata(model_bytes: bytes, metadata: Mapping[str, str]) -> bytes:
    """The same model with `metadata` set in metadata_props (existing keys are replaced)."""
    proto = onnx.load_from_string(model_bytes)
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key not in metadata]
    del proto.metadata_props[:]
    for key, value in [*kept, *metadata.items()]:
        proto.metadata_props.add(key=key, value=value)
    return bytes(proto.SerializeToString())


def read_metadata(path: Path | str) -> dict[str, str]:
    """All metadata_props of an ONNX file, pfl keys and any others, as a plain dict.

    Only the model header is needed, but onnx has no partial reader; the files are small.

    Raises:
        ExportError: the file cannot be read or is not an ONNX model.
    """
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except OSError as error:
        msg = f"cannot read ONNX metadata from {path}: {error}"
        raise ExportError(msg) from error
    except DecodeError as error:
        msg = f"{path} is not an ONNX model: {error}"
        raise ExportError(msg) from error
    if proto.ir_version == 0:  # protobuf parses many byte strings as an empty message
        msg = f"{path} is not an ONNX model (no IR version)"
        raise ExportError(msg)
    return {prop.key: prop.value for prop in proto.metadata_props}
