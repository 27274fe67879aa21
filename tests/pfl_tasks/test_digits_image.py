"""Tests for the digits-image task and its BatchNorm CNN, and the signal models' layouts."""

from __future__ import annotations

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from pfl_tasks.base import PartitionSpec
from pfl_tasks.conv_models import SignalGru, image_cnn, signal_cnn
from pfl_tasks.digits import DigitsTask, load_digits_pool
from pfl_tasks.digits_image import DigitsImageTask, load_digit_images
from pfl_tasks.registry import load_task


def test_images_are_the_digits_upsampled() -> None:
    # Execute
    images, labels = load_digit_images()

    # Assert: 16x16 in [0, 1]; a 2x2 average brings back roughly its own 8x8 pixels
    pixels, digit_labels = load_digits_pool()
    assert images.shape == (1797, 1, 16, 16)
    assert float(images.min()) >= 0.0
    assert float(images.max()) <= 1.0
    assert torch.equal(labels, digit_labels)
    pooled = torch.nn.functional.avg_pool2d(images, 2).reshape(-1, 64)
    own = float((pooled - pixels).abs().mean())
    others = float((pooled - pixels.roll(1, dims=0)).abs().mean())
    assert own < 0.1
    assert own < others / 2


def test_fleets_hold_the_same_samples_as_the_digits_task() -> None:
    spec = PartitionSpec(scheme="dirichlet", alpha=0.5)
    flat = DigitsTask().make_fleet(8, spec, 4)
    images = DigitsImageTask().make_fleet(8, spec, 4)
    for a, b in zip(flat, images, strict=True):
        assert torch.equal(a.train.targets, b.train.targets)
        assert b.train.inputs.shape[1:] == (1, 16, 16)


def test_the_batchnorm_cnn_has_running_statistics_and_trains_in_both_modes() -> None:
    # Prepare
    model = load_task("digits-image").build_model(0)
    images, labels = load_digit_images()

    # Execute: a few SGD steps in training mode, then an evaluation
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, 400, 20):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(images[start : start + 20]), labels[start : start + 20]
        )
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        scores = model(images[:50])

    # Assert
    state = model.state_dict()
    assert {"norm1.running_mean", "norm1.running_var", "norm2.num_batches_tracked"} <= set(state)
    assert state["norm2.num_batches_tracked"].dtype == torch.int64
    assert int(state["norm1.num_batches_tracked"]) == 20
    assert float(state["norm1.running_mean"].abs().sum()) > 0.0
    assert scores.shape == (50, 10)
    assert sum(p.numel() for p in model.parameters()) == 10026


@pytest.mark.parametrize("norm", ["group", "none"])
def test_other_norms_hold_no_buffers(norm: str) -> None:
    model = load_task("digits-image", {"norm": norm}).build_model(0)
    assert [name for name, _ in model.named_buffers()] == []


def test_models_name_their_first_and_last_layers_input_and_output() -> None:
    for model in (signal_cnn(40, 10), SignalGru(40, 10), image_cnn(16, 10)):
        names = [name for name, _ in model.named_parameters()]
        assert names[0].startswith("input.")
        assert names[-1] == "output.bias"


def test_builds_are_seeded() -> None:
    task = DigitsImageTask()
    first, again, other = task.build_model(1), task.build_model(1), task.build_model(2)
    assert torch.equal(first.state_dict()["input.weight"], again.state_dict()["input.weight"])
    assert not torch.equal(first.state_dict()["input.weight"], other.state_dict()["input.weight"])


def test_unknown_norm_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="valid choices: batch, group, none"):
        DigitsImageTask(norm="layer")  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_batchnorm_cnn_trains_under_fedavg_in_a_simulation() -> None:
    # Prepare
    settings = SimulationSettings.load(
        None, task="digits-image", algorithm="fedavg", devices=3, rounds=3, workers=1, seed=0
    )

    # Execute
    result = run_simulation(settings)

    # Assert: well above chance (10%) on the devices' own test splits
    assert result.summary["rounds"] == 3
    assert result.summary["metrics"]["global"] > 0.5
