"""Tests for the digits task: pooled data, fleets and the seeded MLP."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from pfl_tasks.base import DeviceData, PartitionScheme, PartitionSpec, Task
from pfl_tasks.digits import DigitsTask
from pfl_tasks.presets import resolve_preset
from pfl_tasks.split import ParamSplit

# sha256 prefixes of `_fleet_digest(DigitsTask().make_fleet(20, PartitionSpec(scheme=s), 3))`,
# computed before the "groups" scheme and the groups/fraction fields existed.
FLEET_DIGESTS_BEFORE_GROUPS = {
    "iid": "b54284455f2f9ba4",
    "dirichlet": "64651742c8cc1cb9",
    "shards": "5fefd143e2d6427e",
    "powerlaw": "a0d3acf1aa67b774",
}


def _same_fleet(a: list[DeviceData], b: list[DeviceData]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.train.inputs, y.train.inputs)
        and torch.equal(x.train.targets, y.train.targets)
        and torch.equal(x.test.targets, y.test.targets)
        for x, y in zip(a, b, strict=True)
    )


def _fleet_digest(fleet: list[DeviceData]) -> str:
    digest = hashlib.sha256()
    for device in fleet:
        for split in (device.train, device.val, device.test):
            digest.update(split.targets.numpy().tobytes())
            digest.update(split.inputs.numpy().tobytes())
    return digest.hexdigest()[:16]


def _device_labels(device: DeviceData) -> set[int]:
    return set(torch.cat([device.train.targets, device.val.targets, device.test.targets]).tolist())


def test_digits_task_satisfies_the_task_protocol() -> None:
    # Execute
    task = DigitsTask()

    # Assert
    assert isinstance(task, Task)
    assert task.name == "digits"
    assert task.metric_name == "accuracy"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "powerlaw", "groups"])
def test_fleet_of_20_devices_has_usable_splits(scheme: PartitionScheme) -> None:
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
def test_fleet_of_100_balanced_devices_gives_about_a_dozen_train_samples(
    scheme: PartitionScheme,
) -> None:
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


@pytest.mark.parametrize("scheme", sorted(FLEET_DIGESTS_BEFORE_GROUPS))
def test_fleets_of_existing_schemes_are_unchanged(scheme: PartitionScheme) -> None:
    # Execute
    fleet = DigitsTask().make_fleet(20, PartitionSpec(scheme=scheme, groups=4), seed=3)

    # Assert
    assert _fleet_digest(fleet) == FLEET_DIGESTS_BEFORE_GROUPS[scheme]
    assert all(device.truth == {} for device in fleet)


def test_groups_fleet_records_each_devices_label_group() -> None:
    # Prepare: federico.md 5.6's digits analogue, K = 8, a 25% subsample, D = 3.
    spec = PartitionSpec(scheme="groups", groups=3, fraction=0.25)

    # Execute
    fleet = DigitsTask().make_fleet(8, spec, seed=0)

    # Assert: floor(1797 * 0.25) samples; disjoint label sets per group, all ten classes.
    assert sum(len(d.train) + len(d.val) + len(d.test) for d in fleet) == 449
    held: dict[int, set[int]] = {}
    for device in fleet:
        held.setdefault(int(device.truth["group"]), set()).update(_device_labels(device))
    assert sorted(held) == [0, 1, 2]
    assert sorted(len(classes) for classes in held.values()) == [3, 3, 4]
    assert set().union(*held.values()) == set(range(10))


def test_linear_model_is_softmax_regression_named_output() -> None:
    # Prepare
    task = DigitsTask(model="linear")

    # Execute
    model = task.build_model(seed=0)

    # Assert: one Linear(64, 10); the task's patterns and the presets all name it.
    assert sum(p.numel() for p in model.parameters()) == 650
    assert set(model.state_dict()) == {"output.weight", "output.bias"}
    assert model(torch.zeros(3, 64)).shape == (3, 10)
    assert ParamSplit.for_model(model, task.personal_patterns).shared == ()
    assert resolve_preset("output", model) == ("output",)
    assert resolve_preset("input", model) == ("output",)
    again = task.build_model(seed=0).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())


def test_linear_model_trains() -> None:
    # Prepare
    task = DigitsTask(model="linear")
    device = task.make_fleet(4, PartitionSpec(scheme="groups", groups=2), seed=0)[0]
    model = task.build_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, targets = device.train.inputs, device.train.targets
    with torch.no_grad():
        before = float(task.loss(model(inputs), targets))

    # Execute
    for _ in range(5):
        optimizer.zero_grad()
        task.loss(model(inputs), targets).backward()
        optimizer.step()

    # Assert
    with torch.no_grad():
        after = float(task.loss(model(inputs), targets))
    assert after < 0.8 * before


def test_linear_model_rejects_adapters() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="mlp model only"):
        DigitsTask(model="linear", adapters=4)
