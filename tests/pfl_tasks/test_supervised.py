"""supervised_task: your own model and data as a task, checked before any round."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pfl_tasks.base import PartitionSpec
from pfl_tasks.datadir import save_device_data, split_arrays
from pfl_tasks.supervised import supervised_task


def _mlp(inputs: int = 4, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 8), nn.ReLU(), nn.Linear(8, classes))


def _pool(samples: int = 120, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(samples, 4)), rng.integers(0, 3, size=samples)


def test_a_pooled_task_partitions_every_sample_once_across_devices() -> None:
    # Prepare
    inputs, targets = _pool()
    task = supervised_task("pool", _mlp, inputs=inputs, targets=targets, personal=("2.*",))

    # Execute
    fleet = task.make_fleet(4, PartitionSpec(scheme="iid"), seed=0)

    # Assert
    assert sum(len(d.train) + len(d.val) + len(d.test) for d in fleet) == 120
    rows = torch.cat([torch.cat([d.train.inputs, d.val.inputs, d.test.inputs]) for d in fleet])
    assert torch.unique(rows, dim=0).shape[0] == 120
    assert fleet[0].train.inputs.dtype == torch.float32
    assert fleet[0].train.targets.dtype == torch.int64
    assert task.name == "pool"
    assert task.personal_patterns == ("2.*",)


def test_models_are_seeded_so_every_run_with_a_seed_starts_equal() -> None:
    inputs, targets = _pool()
    task = supervised_task("seeded", _mlp, inputs=inputs, targets=targets)

    first, again, other = (task.build_model(s).state_dict() for s in (3, 3, 4))

    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["0.weight"], other["0.weight"])


def test_mean_squared_error_sums_the_per_sample_mean_over_outputs() -> None:
    # Prepare: two samples with two outputs each
    inputs, _ = _pool(samples=10)
    task = supervised_task(
        "reg", lambda: _mlp(classes=2), inputs=inputs, targets=np.zeros((10, 2)), metric="mse"
    )
    outputs = torch.tensor([[1.0, 3.0], [0.0, 2.0]])

    # Execute
    total = task.metric_sum(outputs, torch.zeros(2, 2))

    # Assert: the per-sample means are 10/2 and 4/2
    assert total == pytest.approx(7.0)
    assert float(task.loss(outputs, torch.zeros(2, 2))) == pytest.approx(14.0 / 4)


@pytest.mark.parametrize(
    ("model", "targets", "says"),
    [
        (lambda: _mlp(inputs=5), np.zeros(20, dtype=np.int64), "mat1 and mat2"),
        (lambda: _mlp(classes=2), np.full(20, 2), "labels span 2..2 but the model has 2 outputs"),
        (_mlp, np.linspace(0, 1, 20), "integer class labels"),
    ],
    ids=["input width", "label beyond the outputs", "float labels"],
)
def test_data_that_does_not_fit_the_model_fails_at_once_in_one_line(model, targets, says) -> None:
    inputs = np.random.default_rng(0).normal(size=(20, 4))

    with pytest.raises(ValueError, match=says) as caught:
        supervised_task("misfit", model, inputs=inputs, targets=targets)

    assert "\n" not in str(caught.value)


def test_device_directories_are_the_simulated_fleet(tmp_path: Path) -> None:
    # Prepare: three devices' --data directories
    for index in range(3):
        inputs, targets = _pool(samples=30, seed=index)
        save_device_data(
            split_arrays(inputs, targets, PartitionSpec(), index), tmp_path / f"d{index}"
        )
    task = supervised_task("dirs", _mlp, devices=tmp_path)

    # Execute
    fleet = task.make_fleet(3, PartitionSpec(), seed=0)

    # Assert
    assert [len(d.train) + len(d.val) + len(d.test) for d in fleet] == [30, 30, 30]
    with pytest.raises(ValueError, match="3 device directories, 4 devices asked for"):
        task.make_fleet(4, PartitionSpec(), seed=0)


def test_a_device_directory_that_does_not_fit_is_named(tmp_path: Path) -> None:
    inputs, targets = _pool(samples=30)
    save_device_data(split_arrays(inputs[:, :3], targets, PartitionSpec(), 0), tmp_path / "bad")
    task = supervised_task("dirs", _mlp, devices=tmp_path)

    with pytest.raises(ValueError, match=r"bad: inputs of per-sample shape \(3,\)"):
        task.make_fleet(1, PartitionSpec(), seed=0)


def test_a_pool_and_directories_are_one_or_the_other(tmp_path: Path) -> None:
    inputs, targets = _pool()
    with pytest.raises(ValueError, match="either inputs= and targets="):
        supervised_task("both", _mlp, inputs=inputs, targets=targets, devices=tmp_path)
    with pytest.raises(ValueError, match="either inputs= and targets="):
        supervised_task("neither", _mlp)
    with pytest.raises(ValueError, match="holds no device directories"):
        supervised_task("empty", _mlp, devices=tmp_path)


def test_a_task_file_in_the_working_directory_simulates_end_to_end(tmp_path, monkeypatch) -> None:
    """Through the real coordinator and agents, loaded as `--task module:attribute`."""
    from coordinator.run.settings import SimulationSettings
    from coordinator.run.simulate import run_simulation

    # Prepare: a learnable rule (the sign of the first input)
    (tmp_path / "threshold_task.py").write_text(
        "import numpy as np\n"
        "from torch import nn\n"
        "from pfl_tasks.supervised import supervised_task\n"
        "x = np.random.default_rng(0).normal(size=(200, 4))\n"
        "task = supervised_task('threshold', lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(),"
        " nn.Linear(8, 2)), inputs=x, targets=(x[:, 0] > 0).astype(int), personal=('2.*',))\n"
    )
    monkeypatch.chdir(tmp_path)
    settings = SimulationSettings.load(
        None, task="threshold_task:task", algorithm="fedalt", devices=4, rounds=10, workers=1
    )

    # Execute
    result = run_simulation(settings.model_copy(update={"out": None}))

    # Assert
    assert result.summary["task"] == "threshold"
    assert result.summary["metrics"]["personalized_mean"] > 0.7
