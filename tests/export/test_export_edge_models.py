"""ONNX export of a CNN, a BatchNorm CNN and a GRU: parity, folded BatchNorm, static int8.

Each model is trained briefly on one device's data, exported through `export_model` (parity
against PyTorch at the held-out inputs and batches of 1 and 17 rows, enforced), and quantized
statically with the device's own training inputs as calibration.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from export import ExportProvenance, export_model
from export.fold import batch_norm_nodes, fold_batch_norms
from export.metadata import read_metadata
from export.onnx_export import DEFAULT_TOLERANCE, to_onnx_bytes
from pfl_tasks.base import PartitionSpec, Task
from pfl_tasks.registry import load_task
from tests.export.conftest import Fit
from tests.export.edge_models import PREPROCESSING, gru_task, with_preprocessing

TASKS = {
    "cnn": lambda: with_preprocessing(load_task("examples.cnn_digits:task")),
    "bn-cnn": lambda: with_preprocessing(load_task("tests.normalization.bn_models:task")),
    "gru": gru_task,
}


def _trained(task: Task, fit: Fit) -> tuple[nn.Module, object]:
    device = task.make_fleet(4, PartitionSpec(scheme="iid"), seed=0)[0]
    model = task.build_model(0)
    model.train()
    return fit(model, task, device.train), device


@pytest.mark.parametrize("name", list(TASKS))
def test_exports_match_pytorch_and_quantize_statically_on_the_devices_data(
    name: str, fit: Fit, provenance: ExportProvenance, tmp_path: Path
) -> None:
    task = TASKS[name]()
    model, device = _trained(task, fit)
    result = export_model(
        model,
        task,
        tmp_path / f"{name}.onnx",
        provenance=provenance,
        shared=dict(model.state_dict()),
        heldout=device.test,  # type: ignore[attr-defined]
        quantize="int8-static",
        calibration=device.train.inputs,  # type: ignore[attr-defined]
    )
    assert result.parity_max_abs_diff <= DEFAULT_TOLERANCE
    assert result.metric == pytest.approx(result.torch_metric, abs=0.01)
    assert result.metric > 0.5  # trained: far above the 0.1 of chance
    quantized = result.quantized
    assert quantized is not None
    assert quantized.metric > result.metric - 0.1  # calibrated int8 keeps the accuracy
    stored = read_metadata(quantized.path)
    assert stored["pfl.quantization"] == "int8-static"
    assert int(stored["pfl.calibration_samples"]) == min(len(device.train), 512)  # type: ignore[attr-defined]
    assert stored["pfl.input_preprocessing"] == PREPROCESSING
    graph = read_metadata(result.path)
    assert graph.get("pfl.folded_batch_norms") == ("3" if name == "bn-cnn" else None)
    assert batch_norm_nodes(result.path.read_bytes()) == 0


def test_folding_removes_every_batch_norm_node_that_an_unfolded_export_keeps(fit: Fit) -> None:
    task = TASKS["bn-cnn"]()
    model, device = _trained(task, fit)
    sample = device.test.inputs[:2]  # type: ignore[attr-defined]
    unfolded = to_onnx_bytes(model.eval(), task, sample)
    # torch.onnx folds the two Conv BatchNorms itself; the Linear's BatchNorm1d survives it
    assert batch_norm_nodes(unfolded) == 1
    folded = model.eval()
    reference = folded(sample).detach()
    assert fold_batch_norms(folded) == 3
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    torch.testing.assert_close(folded(sample), reference, rtol=0, atol=1e-5)
    assert batch_norm_nodes(to_onnx_bytes(folded, task, sample)) == 0


def test_folding_a_training_model_and_static_int8_without_samples_are_refused(
    fit: Fit, provenance: ExportProvenance, tmp_path: Path
) -> None:
    task = TASKS["bn-cnn"]()
    with pytest.raises(ValueError, match="eval mode"):
        fold_batch_norms(task.build_model(0).train())
    model, device = _trained(task, fit)
    with pytest.raises(ValueError, match="calibrates on the device's own inputs"):
        export_model(
            model,
            task,
            tmp_path / "m.onnx",
            provenance=provenance,
            shared={},
            heldout=device.test,  # type: ignore[attr-defined]
            quantize="int8-static",
        )
    assert not (tmp_path / "m.onnx").exists()
