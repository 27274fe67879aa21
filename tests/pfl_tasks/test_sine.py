"""Tests for FedeRiCo's noisy sine-curve task."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pfl_tasks.base import PartitionSpec, Task
from pfl_tasks.sine import SineTask

EDGE_TOLERANCE = 1e-6


@pytest.mark.parametrize("intervals", [4, 3])
def test_inputs_fall_in_each_devices_interval(intervals: int) -> None:
    # Prepare
    task = SineTask(intervals=intervals)
    width = 2 * math.pi / intervals

    # Execute
    fleet = task.make_fleet(8, PartitionSpec(), seed=0)

    # Assert
    for k, device in enumerate(fleet):
        interval = k % intervals
        low, high = -math.pi + interval * width, -math.pi + (interval + 1) * width
        assert device.truth["interval"] == interval
        for split in (device.train, device.val, device.test):
            assert float(split.inputs.min()) >= low - EDGE_TOLERANCE
            assert float(split.inputs.max()) <= high + EDGE_TOLERANCE


def test_split_sizes_dtypes_and_noise_level() -> None:
    # Prepare
    task = SineTask(n_train=20, n_test=400, n_val=10, noise_std=0.1)

    # Execute
    device = task.make_fleet(1, PartitionSpec(), seed=1)[0]

    # Assert
    assert (len(device.train), len(device.val), len(device.test)) == (20, 10, 400)
    assert device.test.inputs.shape == (400, 1)
    assert device.test.targets.shape == (400, 1)
    assert device.test.inputs.dtype == torch.float32
    assert device.test.targets.dtype == torch.float32
    residual = device.test.targets - torch.sin(device.test.inputs)
    assert 0.085 < float(residual.std()) < 0.115
    assert abs(float(residual.mean())) < 0.02


def test_devices_on_the_same_interval_get_different_points() -> None:
    # Execute
    fleet = SineTask().make_fleet(8, PartitionSpec(), seed=2)

    # Assert
    assert fleet[1].truth == fleet[5].truth
    assert not torch.equal(fleet[1].train.inputs, fleet[5].train.inputs)


def test_fleet_is_deterministic_in_the_seed() -> None:
    # Prepare
    task = SineTask()

    # Execute
    first = task.make_fleet(8, PartitionSpec(), seed=3)
    again = task.make_fleet(8, PartitionSpec(), seed=3)
    other = task.make_fleet(8, PartitionSpec(), seed=4)

    # Assert
    assert all(
        torch.equal(a.train.targets, b.train.targets) for a, b in zip(first, again, strict=True)
    )
    assert not torch.equal(first[0].train.targets, other[0].train.targets)


def test_line_model_is_seeded_small_and_named_output() -> None:
    # Prepare
    task = SineTask()

    # Execute
    models = [task.build_model(seed) for seed in range(200)]

    # Assert
    assert isinstance(task, Task)
    assert set(models[0].state_dict()) == {"output.weight", "output.bias"}
    assert torch.equal(
        models[0].state_dict()["output.weight"], task.build_model(0).get_parameter("output.weight")
    )
    slopes = np.array([float(m.state_dict()["output.weight"]) for m in models])
    assert 0.08 < slopes.std() < 0.12
    assert models[0](torch.zeros(6, 1)).shape == (6, 1)


def test_loss_is_mean_and_metric_is_sum_of_squares() -> None:
    # Prepare
    task = SineTask()
    outputs = torch.tensor([[0.0], [1.0], [3.0]])
    targets = torch.tensor([[1.0], [1.0], [1.0]])

    # Execute / Assert
    assert float(task.loss(outputs, targets)) == pytest.approx(5.0 / 3)
    assert task.metric_sum(outputs, targets) == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"intervals": 0}, "intervals"),
        ({"noise_std": -0.1}, "noise_std"),
        ({"n_train": 0}, "n_train"),
    ],
)
def test_invalid_options_are_value_errors(options: dict[str, object], pattern: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        SineTask(**options)  # type: ignore[arg-type]
