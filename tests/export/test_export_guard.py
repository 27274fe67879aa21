"""The personalization guard picks the model that scores better on the validation split."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from export import choose_model
from pfl_tasks.base import DeviceData, Split, Task
from pfl_tasks.registry import load_task

Fit = Callable[..., nn.Module]


def _wrong_labels(split: Split) -> Split:
    """Every label moved to the next class: a device whose training data is mislabelled."""
    return Split(split.inputs, (split.targets + 1) % 10)


def test_guard_ships_the_global_model_when_personalization_hurts(
    fit: Fit, digits: Task, digits_device: DeviceData
) -> None:
    # Prepare: the personalized model learned wrong labels, the global one the right ones;
    # validation is this device's own correctly labelled held-back data
    personalized = fit(digits.build_model(0), digits, _wrong_labels(digits_device.train))
    global_model = fit(digits.build_model(0), digits, digits_device.train)
    validation = digits_device.val

    # Execute
    chosen_model, chosen, scores = choose_model(personalized, global_model, digits, validation)

    # Assert
    assert chosen == "global"
    assert chosen_model is global_model
    assert scores["global"] > 0.8
    assert scores["personalized"] < 0.2


def test_guard_keeps_the_personalized_model_when_it_is_better(
    fit: Fit, digits: Task, digits_device: DeviceData
) -> None:
    personalized = fit(digits.build_model(0), digits, digits_device.train)
    global_model = fit(digits.build_model(0), digits, _wrong_labels(digits_device.train))

    chosen_model, chosen, scores = choose_model(
        personalized, global_model, digits, digits_device.val
    )

    assert chosen == "personalized"
    assert chosen_model is personalized
    assert scores["personalized"] > scores["global"]


def _line(slope: float, intercept: float) -> nn.Module:
    line = nn.Linear(1, 1)
    with torch.no_grad():
        line.weight.fill_(slope)
        line.bias.fill_(intercept)
    return line


@pytest.mark.parametrize(
    ("personalized_line", "global_line", "expected"),
    [
        ((1.0, 0.0), (0.0, 3.0), "personalized"),  # personalized fits y = x; global is far off
        ((0.0, 3.0), (1.0, 0.0), "global"),
    ],
)
def test_for_mse_lower_wins(
    personalized_line: tuple[float, float], global_line: tuple[float, float], expected: str
) -> None:
    # Prepare: validation targets on y = x, where the higher MSE is the plausible wrong pick
    task = load_task("sine")
    inputs = torch.linspace(-1.0, 1.0, 11).unsqueeze(1)
    validation = Split(inputs, inputs.clone())

    # Execute
    _, chosen, scores = choose_model(
        _line(*personalized_line), _line(*global_line), task, validation
    )

    # Assert
    assert chosen == expected
    assert scores[expected] == pytest.approx(0.0, abs=1e-12)
    assert scores["global" if expected == "personalized" else "personalized"] > 1.0


def test_a_tie_goes_to_the_personalized_model(digits: Task, digits_device: DeviceData) -> None:
    personalized = digits.build_model(0)
    global_model = copy.deepcopy(personalized)

    chosen_model, chosen, scores = choose_model(
        personalized, global_model, digits, digits_device.val
    )

    assert chosen == "personalized"
    assert chosen_model is personalized
    assert scores["personalized"] == scores["global"]


def test_an_empty_validation_split_keeps_the_personalized_model(
    digits: Task, digits_device: DeviceData
) -> None:
    empty = Split(digits_device.val.inputs[:0], digits_device.val.targets[:0])

    _, chosen, scores = choose_model(digits.build_model(0), digits.build_model(1), digits, empty)

    assert chosen == "personalized"
    assert math.isnan(scores["personalized"])
    assert math.isnan(scores["global"])


def test_a_model_scoring_nan_loses_to_a_finite_one() -> None:
    task = load_task("sine")
    inputs = torch.linspace(-1.0, 1.0, 5).unsqueeze(1)
    validation = Split(inputs, inputs.clone())

    _, chosen, _ = choose_model(_line(float("nan"), 0.0), _line(5.0, 5.0), task, validation)

    assert chosen == "global"


def test_the_guard_leaves_both_models_in_their_mode(
    digits: Task, digits_device: DeviceData
) -> None:
    personalized, global_model = digits.build_model(0).train(), digits.build_model(1).eval()

    choose_model(personalized, global_model, digits, digits_device.val)

    assert personalized.training
    assert not global_model.training
