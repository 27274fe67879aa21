"""Running an exported model in onnxruntime and measuring how far its outputs are from PyTorch's."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import numpy as np
import onnxruntime as ort
import torch

from pfl_tasks.base import Split, Task

from .errors import ExportError

logger = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, ...]
Predict = Callable[[torch.Tensor], Outputs]

PARITY_BATCH_SIZES: Final = (1, 17)
EVAL_BATCH_SIZE: Final = 1024
ORT_LOG_ERRORS_ONLY: Final = 3


def make_session(model: bytes | Path, threads: int | None = None) -> ort.InferenceSession:
    """An onnxruntime CPU session, the runtime a device will actually deploy with.

    Args:
        model: The serialized model or the path of an ONNX file.
        threads: Intra-op threads; None lets onnxruntime choose (one per physical core).

    Raises:
        ExportError: onnxruntime rejects the model.
    """
    options = ort.SessionOptions()
    options.log_severity_level = ORT_LOG_ERRORS_ONLY
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    source = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(
            source, sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as error:  # onnxruntime raises its own exception types per failure
        msg = f"onnxruntime cannot load the exported model: {type(error).__name__}: {error}"
        raise ExportError(msg) from error


class OnnxPredictor:
    """An onnxruntime session called like the PyTorch model: a tensor batch in, tensors out.

    Shared by the parity check and the held-out metric, so both see the file exactly as a
    deployment would (float inputs converted once, outputs in graph order).
    """

    def __init__(self, session: ort.InferenceSession) -> None:
        inputs = session.get_inputs()
        if len(inputs) != 1:
            msg = f"the ONNX graph has {len(inputs)} inputs; export supports exactly one"
            raise ExportError(msg)
        self.session = session
        self.input_name = inputs[0].name

    def __call__(self, inputs: torch.Tensor) -> Outputs:
        """Run one batch through onnxruntime."""
        feed = {self.input_name: np.ascontiguousarray(inputs.detach().cpu().numpy())}
        return tuple(torch.from_numpy(np.asarray(out)) for out in self.session.run(None, feed))


def as_outputs(value: object) -> Outputs:
    """A PyTorch model's return value as a tuple of tensors, the shape ONNX outputs take.

    Raises:
        ExportError: the model returned something other than a tensor or a tuple/list of them.
    """
    if isinstance(value, torch.Tensor):
        return (value,)
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return tuple(value)
    msg = f"the model must return a tensor or a tuple of tensors, got {type(value).__name__}"
    raise ExportError(msg)


def torch_predictor(model: torch.nn.Module) -> Predict:
    """The PyTorch side of the comparison: eval mode, no autograd, outputs as a tuple."""
    model.eval()

    @torch.no_grad()
    def predict(inputs: torch.Tensor) -> Outputs:
        return as_outputs(model(inputs))

    return predict


def fresh_inputs(sample: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random inputs shaped and typed like `sample`'s rows, scaled like it, from `generator`.

    They probe the dynamic batch axis at sizes the export never traced, and regions of input
    space the held-out rows may not cover.
    """
    shape = (batch_size, *sample.shape[1:])
    if sample.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not sample.is_floating_point():
        low, high = int(sample.min()), int(sample.max())
        return torch.randint(low, high + 1, shape, generator=generator, dtype=sample.dtype)
    values = sample.double()
    centre = float(values.mean())
    spread = float(values.std()) if values.numel() > 1 else 1.0
    if not math.isfinite(spread) or spread == 0.0:
        spread = 1.0
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    return (centre + spread * noise).to(sample.dtype)


def parity_batches(heldout_inputs: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """The held-out inputs in evaluation-sized chunks, then fresh batches of 1 and 17 rows."""
    generator = torch.Generator().manual_seed(seed)
    batches = [
        heldout_inputs[start : start + EVAL_BATCH_SIZE]
        for start in range(0, int(heldout_inputs.shape[0]), EVAL_BATCH_SIZE)
    ]
    batches += [fresh_inputs(heldout_inputs, n, generator) for n in PARITY_BATCH_SIZES]
    return batches


def record_outputs(predict: Predict, batches: Sequence[torch.Tensor]) -> list[Outputs]:
    """The reference outputs, taken once so later changes to the model cannot move them."""
    return [tuple(out.detach().clone() for out in predict(batch)) for batch in batches]


def max_abs_difference(
    expected: Sequence[Outputs], candidate: Predict, batches: Sequence[torch.Tensor]
) -> float:
    """Largest |expected - candidate(batch)| over every output element of every batch.

    NaN in the same place on both sides counts as agreement; NaN or Inf on one side only counts
    as an infinite difference, so a broken export can never pass by producing NaN.

    Raises:
        ExportError: the two disagree on the number or shapes of outputs.
    """
    worst = 0.0
    for batch, want_all in zip(batches, expected, strict=True):
        got_all = candidate(batch)
        if len(want_all) != len(got_all):
            msg = f"PyTorch returns {len(want_all)} outputs but the ONNX model {len(got_all)}"
            raise ExportError(msg)
        for index, (want, got) in enumerate(zip(want_all, got_all, strict=True)):
            if tuple(want.shape) != tuple(got.shape):
                msg = (
                    f"output {index} has shape {tuple(got.shape)} in onnxruntime but "
                    f"{tuple(want.shape)} in PyTorch (batch of {batch.shape[0]})"
                )
                raise ExportError(msg)
            if want.numel() == 0:
                continue
            want64, got64 = want.double(), got.double()
            agree = (want64 == got64) | (want64.isnan() & got64.isnan())
            diff = (want64 - got64).abs().masked_fill(agree, 0.0)
            worst = max(worst, float(torch.nan_to_num(diff, nan=math.inf).max()))
    return worst


def check_parity(
    expected: Sequence[Outputs],
    candidate: Predict,
    batches: Sequence[torch.Tensor],
    tolerance: float,
    *,
    device_id: str | None = None,
    round_id: int | None = None,
) -> float:
    """The max abs difference, refusing an export whose outputs drift beyond `tolerance`.

    Raises:
        ExportError: the difference exceeds `tolerance`, or the outputs disagree in shape.
    """
    difference = max_abs_difference(expected, candidate, batches)
    if not difference <= tolerance:
        msg = (
            f"ONNX parity check failed: max abs difference {difference:.3g} between onnxruntime "
            f"and PyTorch exceeds the tolerance {tolerance:.3g}"
        )
        raise ExportError(msg, device_id=device_id, round_id=round_id)
    logger.debug("ONNX parity max abs difference %.3g (tolerance %.3g)", difference, tolerance)
    return difference


def metric_of(predict: Predict, task: Task, split: Split) -> float:
    """The task's metric (accuracy or MSE) of `predict` over `split`, from its first output.

    The same function scores PyTorch and onnxruntime, so their numbers are comparable.
    """
    if len(split) == 0:
        return math.nan
    total = 0.0
    for start in range(0, len(split), EVAL_BATCH_SIZE):
        outputs = predict(split.inputs[start : start + EVAL_BATCH_SIZE])
        total += task.metric_sum(outputs[0], split.targets[start : start + EVAL_BATCH_SIZE])
    return total / len(split)
