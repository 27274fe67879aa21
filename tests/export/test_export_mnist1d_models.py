"""ONNX export of the MNIST-1D task's convolutional and recurrent models, the paper's CNN too.

Each model is trained briefly on one device's signals and exported through `export_model`, which
enforces parity with PyTorch at the held-out signals and at batches of 1 and 17 rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export import ExportProvenance, export_model
from export.metadata import read_metadata
from export.onnx_export import DEFAULT_TOLERANCE
from pfl_tasks.base import PartitionSpec
from pfl_tasks.mnist1d_task import Mnist1dTask
from tests.export.conftest import Fit


@pytest.mark.parametrize("model", ["cnn-paper", "cnn", "gru"])
def test_mnist1d_models_export_with_parity(
    model: str, fit: Fit, provenance: ExportProvenance, tmp_path: Path
) -> None:
    # Prepare: one of two iid devices (about 2,000 signals), trained 100 full-batch steps of
    # Adam at the paper's learning rate (SGD at the export tests' rate diverges here)
    task = Mnist1dTask(model=model)  # type: ignore[arg-type]
    device = task.make_fleet(2, PartitionSpec(scheme="iid"), seed=0)[0]
    trained = fit(
        task.build_model(0),
        task,
        device.train,
        steps=100,
        optimizer=lambda parameters: torch.optim.Adam(parameters, lr=0.01),
    )

    # Execute
    result = export_model(
        trained,
        task,
        tmp_path / f"{model}.onnx",
        provenance=provenance,
        shared=dict(trained.state_dict()),
        heldout=device.test,
    )

    # Assert: the file computes what the model computes, and the model learned something
    assert result.parity_max_abs_diff <= DEFAULT_TOLERANCE
    assert result.metric == pytest.approx(result.torch_metric, abs=0.01)
    assert result.metric > 0.3  # chance is 0.1
    assert read_metadata(result.path)["pfl.input_preprocessing"] == task.input_preprocessing
