"""Tests for the MNIST-1D task: the offline generator, fleets, sensors and the models."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pfl_tasks.base import PartitionSpec, Task
from pfl_tasks.mnist1d_task import Mnist1dTask, generate_mnist1d
from pfl_tasks.presets import resolve_preset
from pfl_tasks.registry import load_task
from pfl_tasks.signal_shift import device_sensor


def _labels(device_targets: list[torch.Tensor]) -> set[int]:
    return set(torch.cat(device_targets).tolist())


def test_generator_gives_the_published_split_and_leaves_global_random_state_alone() -> None:
    # Prepare
    generate_mnist1d.cache_clear()
    np.random.seed(7)
    random.seed(7)
    expected_numpy, expected_python = np.random.random(), random.random()
    np.random.seed(7)
    random.seed(7)

    # Execute
    data = generate_mnist1d()

    # Assert: 4000/1000 signals of 40 samples, ten balanced classes, unit spread
    assert data.train.inputs.shape == (4000, 40)
    assert data.test.inputs.shape == (1000, 40)
    assert data.train.inputs.dtype == torch.float32
    assert data.train.targets.dtype == torch.int64
    assert torch.bincount(data.pool().targets).tolist() == [500] * 10
    assert abs(float(data.pool().inputs.std()) - 1.0) < 0.01
    assert np.random.random() == expected_numpy
    assert random.random() == expected_python


def test_generation_is_deterministic() -> None:
    first = generate_mnist1d()
    generate_mnist1d.cache_clear()
    second = generate_mnist1d()
    assert torch.equal(first.train.inputs, second.train.inputs)
    assert torch.equal(first.test.targets, second.test.targets)


def test_the_registry_builds_each_model_with_its_options() -> None:
    # Execute
    cnn = load_task("mnist1d").build_model(0)
    bare = load_task("mnist1d", {"norm": "none", "channels": 8}).build_model(0)
    gru = load_task("mnist1d", {"model": "gru"}).build_model(0)
    mlp = load_task("mnist1d", {"model": "mlp"}).build_model(0)
    linear = load_task("mnist1d", {"model": "linear"}).build_model(0)
    paper = load_task("mnist1d", {"model": "cnn-paper"}).build_model(0)
    signals = generate_mnist1d().test.inputs[:5]

    # Assert
    assert isinstance(load_task("mnist1d"), Task)
    sizes = [sum(p.numel() for p in m.parameters()) for m in (cnn, gru, mlp, linear, paper)]
    assert sizes == [16906, 5134, 5110, 410, 5210]
    assert not any("norm" in name for name in bare.state_dict())
    assert "norm1.weight" in cnn.state_dict()
    for model in (cnn, bare, gru, mlp, linear, paper):
        assert model(signals).shape == (5, 10)
    # The paper's CNN: strided convolutions 40 -> 19 -> 10 -> 5 samples, 25 channels, no norm
    assert [
        tuple(paper.state_dict()[f"{n}.weight"].shape) for n in ("input", "conv2", "conv3")
    ] == [
        (25, 1, 5),
        (25, 25, 3),
        (25, 25, 3),
    ]
    assert tuple(paper.state_dict()["output.weight"].shape) == (10, 125)
    assert not any("norm" in name for name in paper.state_dict())
    assert resolve_preset("input", paper) == ("input",)
    assert resolve_preset("output", cnn) == ("output",)
    assert resolve_preset("input", cnn) == ("input",)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"model": "lstm"}, "valid choices: cnn, cnn-bn, cnn-paper, gru, mlp, linear"),
        ({"shift": "label"}, "valid choices: none, feature"),
        ({"norm": "layer"}, "valid choices: group, batch, none"),
        ({"model": "cnn-bn", "norm": "group"}, "contradicts"),
        ({"shift_scale": -1.0}, "shift_scale"),
        ({"hidden": 0}, "hidden"),
        ({"kernel": 3}, "unknown options"),
    ],
)
def test_bad_options_are_value_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_task("mnist1d", options)


def test_label_skew_uses_the_partitioners_and_keeps_inputs_unshifted() -> None:
    # Execute
    fleet = Mnist1dTask().make_fleet(10, PartitionSpec(scheme="shards", labels_per_device=2), 3)

    # Assert: two labels each, every signal an untouched row of the pool
    pool = generate_mnist1d().pool().inputs
    for device in fleet:
        assert len(_labels([device.train.targets, device.val.targets, device.test.targets])) == 2
        assert device.truth == {}
        rows = (device.train.inputs[:, None, :] == pool[None, :, :]).all(dim=-1).any(dim=-1)
        assert bool(rows.all())


def test_feature_shift_gives_each_device_its_own_sensor_over_all_classes() -> None:
    # Prepare
    spec = PartitionSpec(scheme="iid")
    plain = Mnist1dTask().make_fleet(6, spec, 5)

    # Execute
    shifted = Mnist1dTask(shift="feature").make_fleet(6, spec, 5)
    again = Mnist1dTask(shift="feature").make_fleet(6, spec, 5)
    other_seed = Mnist1dTask(shift="feature").make_fleet(6, spec, 6)

    # Assert: same samples and labels, other inputs; deterministic in the seed
    gains = set()
    for before, after, repeat in zip(plain, shifted, again, strict=True):
        assert torch.equal(before.train.targets, after.train.targets)
        assert len(_labels([after.train.targets])) == 10
        assert not torch.allclose(before.train.inputs, after.train.inputs)
        assert torch.equal(after.train.inputs, repeat.train.inputs)
        assert torch.equal(after.test.inputs, repeat.test.inputs)
        assert set(after.truth) == {"gain", "offset", "noise", "warp"}
        gains.add(after.truth["gain"])
        assert abs(float(after.train.inputs.mean()) - after.truth["offset"]) < 0.25
    assert len(gains) == 6
    assert other_seed[0].truth != shifted[0].truth


def test_a_devices_sensor_depends_on_the_seed_and_its_index_not_the_fleet_size() -> None:
    spec = PartitionSpec(scheme="iid")
    small = Mnist1dTask(shift="feature").make_fleet(3, spec, 1)
    large = Mnist1dTask(shift="feature").make_fleet(9, spec, 1)
    assert [d.truth for d in small] == [d.truth for d in large[:3]]


def test_shift_scale_zero_is_no_shift() -> None:
    spec = PartitionSpec(scheme="iid")
    plain = Mnist1dTask().make_fleet(4, spec, 2)
    zero = Mnist1dTask(shift="feature", shift_scale=0.0).make_fleet(4, spec, 2)
    for before, after in zip(plain, zero, strict=True):
        assert torch.allclose(before.train.inputs, after.train.inputs, atol=1e-6)
        assert after.truth == {"gain": 1.0, "offset": 0.0, "noise": 0.0, "warp": 1.0}


def test_sensor_applies_gain_offset_and_warp_as_documented() -> None:
    # Prepare: a ramp, which a power warp bends and gain/offset map linearly
    sensor, rng = device_sensor(0, 0)
    quiet = type(sensor)(gain=2.0, offset=0.5, noise=0.0, warp=2.0)
    ramp = torch.linspace(0.0, 1.0, 40, dtype=torch.float64)[None, :]

    # Execute
    recorded = quiet.apply(ramp, rng)

    # Assert: x(t) = t becomes 2 t^2 + 0.5 at the 40 sample points
    expected = 2.0 * ramp**2 + 0.5
    assert torch.allclose(recorded, expected, atol=1e-12)
