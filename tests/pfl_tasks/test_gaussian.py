"""Tests for Self-FL's scalar two-level Gaussian task."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pfl_tasks.base import PartitionSpec, Task
from pfl_tasks.gaussian import GaussianTask


def test_train_means_sit_near_each_devices_theta() -> None:
    # Prepare
    task = GaussianTask(sigma0_sq=1.0, obs_var=0.1, n_min=10, n_max=200)

    # Execute
    fleet = task.make_fleet(200, PartitionSpec(), seed=0)

    # Assert: standardized errors (mean - theta) / sqrt(obs_var / N) are ~ N(0, 1).
    z = np.array(
        [
            (float(d.train.targets.mean()) - d.truth["theta"])
            / math.sqrt(0.1 / d.truth["num_observations"])
            for d in fleet
        ]
    )
    assert abs(z.mean()) < 0.3
    assert 0.8 < z.std() < 1.2
    assert np.abs(z).max() < 4.5


def test_theta_spread_matches_sigma0_sq() -> None:
    # Prepare
    task = GaussianTask(sigma0_sq=0.25, theta_0=-2.0)

    # Execute
    fleet = task.make_fleet(2000, PartitionSpec(), seed=1)

    # Assert
    thetas = np.array([d.truth["theta"] for d in fleet])
    assert abs(thetas.mean() - (-2.0)) < 0.05
    assert abs(thetas.var() - 0.25) < 0.035


def test_case_one_sizes_are_uniform_and_inclusive() -> None:
    # Prepare
    task = GaussianTask(sigma0_sq=0.001, n_min=10, n_max=20)

    # Execute
    fleet = task.make_fleet(500, PartitionSpec(), seed=2)

    # Assert
    sizes = {len(d.train) for d in fleet}
    assert sizes == set(range(10, 21))
    assert all(d.truth["num_observations"] == len(d.train) for d in fleet)
    assert all(d.truth["sigma0_sq"] == 0.001 for d in fleet)


def test_splits_have_the_configured_shapes_and_fresh_observations() -> None:
    # Prepare
    task = GaussianTask(n_test=50, n_val=7)

    # Execute
    device = task.make_fleet(3, PartitionSpec(), seed=3)[2]

    # Assert
    assert device.device_index == 2
    assert device.train.inputs.shape == (device.truth["num_observations"], 1)
    assert device.train.targets.dtype == torch.float32
    assert device.val.targets.shape == (7, 1)
    assert device.test.targets.shape == (50, 1)
    assert torch.count_nonzero(device.test.inputs) == 0
    assert not torch.equal(device.test.targets[:7], device.val.targets)
    assert abs(float(device.test.targets.mean()) - device.truth["theta"]) < 0.2


def test_fleet_is_deterministic_and_prefix_stable() -> None:
    # Prepare
    task = GaussianTask()

    # Execute
    small = task.make_fleet(4, PartitionSpec(), seed=7)
    large = task.make_fleet(9, PartitionSpec(), seed=7)
    other = task.make_fleet(4, PartitionSpec(), seed=8)

    # Assert
    for a, b in zip(small, large[:4], strict=True):
        assert a.truth == b.truth
        assert torch.equal(a.train.targets, b.train.targets)
    assert [d.truth["theta"] for d in small] != [d.truth["theta"] for d in other]


def test_one_gradient_step_moves_theta_toward_the_sample_mean() -> None:
    # Prepare
    task = GaussianTask()
    device = task.make_fleet(1, PartitionSpec(), seed=4)[0]
    model = task.build_model(seed=123)
    eta = 0.3
    sample_mean = float(device.train.targets.double().mean())

    # Execute
    loss = task.loss(model(device.train.inputs), device.train.targets)
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            assert parameter.grad is not None
            parameter.sub_(eta * parameter.grad)

    # Assert: theta_1 = theta_0 + eta * (mean - theta_0), with theta_0 = 0.
    assert isinstance(task, Task)
    assert list(model.state_dict()) == ["theta"]
    assert float(model.state_dict()["theta"]) == pytest.approx(eta * sample_mean, rel=1e-5)


def test_model_predicts_theta_for_every_row_and_metric_sums_squares() -> None:
    # Prepare
    task = GaussianTask()
    model = task.build_model(seed=0)
    with torch.no_grad():
        model.state_dict()["theta"].fill_(1.5)
    targets = torch.tensor([[1.0], [2.0], [4.5]])

    # Execute
    outputs = model(torch.zeros(3, 1))

    # Assert
    assert outputs.shape == (3, 1)
    assert task.metric_sum(outputs, targets) == pytest.approx(0.25 + 0.25 + 9.0)
    assert task.loss(outputs, targets).item() == pytest.approx(0.5 * 9.5 / 3)


def test_initial_theta_is_zero_for_any_seed() -> None:
    # Execute
    values = {float(GaussianTask().build_model(seed).state_dict()["theta"]) for seed in range(3)}

    # Assert
    assert values == {0.0}


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"n_min": 20, "n_max": 10}, "n_max"),
        ({"obs_var": 0.0}, "obs_var"),
        ({"sigma0_sq": -1.0}, "sigma0_sq"),
        ({"n_test": 0}, "n_test"),
        ({"theta_0": float("inf")}, "theta_0"),
    ],
)
def test_invalid_options_are_value_errors(options: dict[str, object], pattern: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        GaussianTask(**options)  # type: ignore[arg-type]
