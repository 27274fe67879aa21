"""Tests for the digits task: pooled data, fleets and the seeded MLP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.base import DeviceData, PartitionSpec, Task
from tasks.digits import DigitsTask


def _same_fleet(a: list[DeviceData], b: list[DeviceData]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.train.inputs, y.train.inputs)
        and torch.equal(x.train.targets, y.train.targets)
        and torch.equal(x.test.targets, y.test.targets)
        for x, y in zip(a, b, strict=True)
    )


def test_digits_task_satisfies_the_task_protocol() -> None:
    # Execute
    task = DigitsTask()

    # Assert
    assert isinstance(task, Task)
    assert task.name == "digits"
    assert task.metric_name == "accuracy"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "powerlaw"])
def test_fleet_of_20_devices_has_usable_splits(scheme: str) -> None:
    # Prepare
    task = DigitsTask()

    # Execute
    fleet = task.make_fleet(20, PartitionSpec(scheme=scheme), seed=0)

    # Assert
    assert [d.device_index for d in fleet] == list(range(20))
    assert sum(len(d.train) + len(d.val) + len(d.test) for d in fleet) == 1797
    for device in fleet:
        assert len(device.train) >= 1
        assert len(device.test) >= 1
        assert device.train.inputs.dtype == torch.float32
        assert device.train.inputs.shape[1:] == (64,)
        assert device.train.targets.dtype == torch.int64
        assert float(device.train.inputs.min()) >= 0.0
        assert float(device.train.inputs.max()) <= 1.0


@pytest.mark.parametrize("scheme", ["iid", "shards"])
def test_fleet_of_100_balanced_devices_gives_about_a_dozen_train_samples(scheme: str) -> None:
    # Execute
    fleet = DigitsTask().make_fleet(100, PartitionSpec(scheme=scheme), seed=0)

    # Assert
    train_sizes = np.array([len(d.train) for d in fleet])
    assert train_sizes.min() >= 9
    assert train_sizes.max() <= 14
    assert all(len(d.test) >= 4 for d in fleet)


def test_fleet_of_100_devices_works_with_the_default_partition() -> None:
    # Execute
    fleet = DigitsTask().make_fleet(100, PartitionSpec(), seed=0)

    # Assert
    train_sizes = np.array([len(d.train) for d in fleet])
    assert 10 <= train_sizes.mean() <= 13
    assert all(len(d.train) >= 1 and len(d.test) >= 1 for d in fleet)


def test_fleet_is_deterministic_in_the_seed() -> None:
    # Prepare
    task = DigitsTask()
    spec = PartitionSpec(scheme="dirichlet", alpha=0.5)

    # Execute
    first = task.make_fleet(20, spec, seed=3)
    again = task.make_fleet(20, spec, seed=3)
    other = task.make_fleet(20, spec, seed=4)

    # Assert
    assert _same_fleet(first, again)
    assert not _same_fleet(first, other)


def test_shards_fleet_holds_two_labels_per_device() -> None:
    # Execute
    fleet = DigitsTask().make_fleet(20, PartitionSpec(scheme="shards"), seed=1)

    # Assert
    for device in fleet:
        labels = torch.cat([device.train.targets, device.val.targets, device.test.targets])
        assert len(torch.unique(labels)) == 2


def test_build_model_depends_only_on_the_seed_and_keeps_global_rng() -> None:
    # Prepare
    task = DigitsTask(hidden=16)
    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)

    # Execute
    first = task.build_model(seed=7)
    observed_next = torch.rand(3)
    again = task.build_model(seed=7)
    other = task.build_model(seed=8)

    # Assert
    assert torch.equal(observed_next, expected_next)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key])
    assert not torch.equal(first.state_dict()["output.weight"], other.state_dict()["output.weight"])
    assert first.state_dict()["hidden.weight"].shape == (16, 64)


def test_model_output_matches_personal_patterns_and_output_names() -> None:
    # Prepare
    task = DigitsTask()
    model = task.build_model(seed=0)

    # Execute
    logits = model(torch.zeros(5, 64))

    # Assert
    assert logits.shape == (5, 10)
    assert set(model.state_dict()) == {
        "hidden.weight",
        "hidden.bias",
        "output.weight",
        "output.bias",
    }
    assert task.personal_patterns == ("output.*",)


def test_loss_and_metric_sum() -> None:
    # Prepare
    task = DigitsTask()
    outputs = torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0], [1.0, 0.0, 5.0]])
    targets = torch.tensor([0, 2, 2])

    # Execute
    correct = task.metric_sum(outputs, targets)
    loss = task.loss(outputs, targets)

    # Assert
    assert correct == 2.0
    expected = -torch.log_softmax(outputs, dim=1)[torch.arange(3), targets].mean()
    assert torch.isclose(loss, expected)


@pytest.mark.parametrize("hidden", [0, -3, 2.5, True, "64"])
def test_invalid_hidden_is_a_value_error(hidden: object) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="hidden"):
        DigitsTask(hidden=hidden)  # type: ignore[arg-type]
