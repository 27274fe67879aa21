"""Tests for the Synthetic(alpha, beta) generator and its models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from pfl_tasks.base import PartitionSpec, Task
from pfl_tasks.synthetic import SyntheticTask


def test_a_thousand_devices_generate_with_labels_in_range() -> None:
    # Prepare
    task = SyntheticTask(max_samples=1000)

    # Execute
    fleet = task.make_fleet(1000, PartitionSpec(), seed=0)

    # Assert
    assert len(fleet) == 1000
    sizes = np.array([len(d.train) + len(d.val) + len(d.test) for d in fleet])
    assert sizes.min() >= 50
    assert sizes.max() <= 1000
    assert (sizes == 1000).any()
    for device in fleet:
        assert len(device.train) >= 1
        assert len(device.test) >= 1
        for split in (device.train, device.val, device.test):
            assert split.inputs.dtype == torch.float32
            assert split.inputs.shape[1:] == (60,)
            assert split.targets.dtype == torch.int64
            if len(split):
                assert int(split.targets.min()) >= 0
                assert int(split.targets.max()) < 10


def _held_out_linear_accuracy(
    train_inputs: torch.Tensor,
    train_targets: torch.Tensor,
    test_inputs: torch.Tensor,
    test_targets: torch.Tensor,
) -> float:
    """Test accuracy of nearly unregularized multinomial logistic regression fitted on train."""
    model = LogisticRegression(C=1e4, max_iter=2000)
    model.fit(train_inputs.numpy(), train_targets.numpy())
    return float(model.score(test_inputs.numpy(), test_targets.numpy()))


def test_labels_are_the_argmax_of_a_per_device_linear_model() -> None:
    # Prepare: the most label-diverse large device, so a linear fit must beat the majority class,
    # and a control with shuffled training labels that has nothing linear to find.
    fleet = SyntheticTask().make_fleet(20, PartitionSpec(test_fraction=0.3), seed=1)
    device = min(
        (d for d in fleet if len(d.train) >= 300),
        key=lambda d: float(torch.bincount(d.train.targets, minlength=10).max()) / len(d.train),
        default=None,
    )
    assert device is not None
    majority = float(torch.bincount(device.test.targets, minlength=10).max()) / len(device.test)
    permutation = torch.randperm(len(device.train), generator=torch.Generator().manual_seed(0))
    shuffled = device.train.targets[permutation]

    # Execute
    accuracy = _held_out_linear_accuracy(
        device.train.inputs, device.train.targets, device.test.inputs, device.test.targets
    )
    control = _held_out_linear_accuracy(
        device.train.inputs, shuffled, device.test.inputs, device.test.targets
    )

    # Assert
    assert majority < 0.8
    assert accuracy > 0.9
    assert control < majority + 0.05


def test_split_sizes_follow_the_partition_fractions() -> None:
    # Execute
    fleet = SyntheticTask(max_samples=60).make_fleet(
        5, PartitionSpec(test_fraction=0.5, val_fraction=0.0), seed=2
    )

    # Assert
    for device in fleet:
        assert len(device.val) == 0
        assert len(device.test) == len(device.train)


def test_fleet_is_deterministic_and_prefix_stable() -> None:
    # Prepare
    task = SyntheticTask()

    # Execute
    small = task.make_fleet(5, PartitionSpec(), seed=3)
    large = task.make_fleet(50, PartitionSpec(), seed=3)
    other = task.make_fleet(5, PartitionSpec(), seed=4)

    # Assert
    for a, b in zip(small, large[:5], strict=True):
        assert torch.equal(a.train.inputs, b.train.inputs)
        assert torch.equal(a.test.targets, b.test.targets)
    assert not torch.equal(small[0].train.inputs[:5], other[0].train.inputs[:5])


def test_larger_alpha_makes_devices_label_differently() -> None:
    # Prepare: device model means u_k ~ N(0, alpha) shift every logit, so the spread of the
    # ground-truth means grows with alpha.
    spec = PartitionSpec()

    # Execute
    calm = SyntheticTask(alpha=0.0, beta=0.0).make_fleet(200, spec, seed=5)
    wild = SyntheticTask(alpha=1.0, beta=1.0).make_fleet(200, spec, seed=5)

    # Assert
    assert all(d.truth["model_mean"] == 0.0 for d in calm)
    spread = np.std([d.truth["model_mean"] for d in wild])
    assert 0.8 < spread < 1.2


@pytest.mark.parametrize(
    ("model", "expected_keys"),
    [
        ("mlp", {"hidden.weight", "hidden.bias", "output.weight", "output.bias"}),
        ("mclr", {"output.weight", "output.bias"}),
    ],
)
def test_models_name_their_personal_output_layer(model: str, expected_keys: set[str]) -> None:
    # Prepare
    task = SyntheticTask(model=model)  # type: ignore[arg-type]

    # Execute
    net = task.build_model(seed=0)
    logits = net(torch.zeros(4, 60))

    # Assert
    assert isinstance(task, Task)
    assert set(net.state_dict()) == expected_keys
    assert logits.shape == (4, 10)
    assert torch.equal(
        net.state_dict()["output.weight"], task.build_model(0).state_dict()["output.weight"]
    )


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"model": "cnn"}, "valid choices: mlp, mclr"),
        ({"alpha": -1.0}, "alpha"),
        ({"beta": float("nan")}, "beta"),
        ({"max_samples": 1}, "max_samples"),
    ],
)
def test_invalid_options_are_value_errors(options: dict[str, object], pattern: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        SyntheticTask(**options)  # type: ignore[arg-type]
