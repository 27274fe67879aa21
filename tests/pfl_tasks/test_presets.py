"""Presets pick the spec's partitions (§2.1) on the built-in models; configs select them."""

import pytest
from torch import nn

from pfl_tasks.digits import DigitsTask
from pfl_tasks.presets import PRESETS, resolve_preset
from pfl_tasks.split import ParamSplit, resolve_split
from pfl_tasks.synthetic import SyntheticTask
from protocols.algorithms import FedAltConfig, FedAvgConfig, parse_algorithm_config

HIDDEN = ("hidden.weight", "hidden.bias")
OUTPUT = ("output.weight", "output.bias")
ADAPTER = (
    "act_adapter.down.weight",
    "act_adapter.down.bias",
    "act_adapter.up.weight",
    "act_adapter.up.bias",
)


def _personal(model: nn.Module, preset: str) -> tuple[str, ...]:
    return ParamSplit.for_model(model, resolve_preset(preset, model)).personal


@pytest.mark.parametrize(
    ("options", "preset", "expected"),
    [
        ({}, "output", OUTPUT),
        ({}, "input", HIDDEN),
        ({}, "all", HIDDEN + OUTPUT),
        ({}, "none", ()),
        ({"adapters": 16}, "adapters", ADAPTER),
        ({"adapters": 16}, "output", OUTPUT),
        ({"adapters": 16}, "input", HIDDEN),
        ({"model": "split-input"}, "split-input", ("private_input.weight", "private_input.bias")),
        ({"model": "split-input"}, "input", ("shared_input.weight", "shared_input.bias")),
        ({"model": "split-input"}, "output", OUTPUT),
    ],
)
def test_presets_pick_the_right_tensors_of_the_digits_models(
    options: dict[str, object], preset: str, expected: tuple[str, ...]
) -> None:
    model = DigitsTask(**options).build_model(0)  # type: ignore[arg-type]
    assert _personal(model, preset) == expected


def test_input_and_output_are_the_one_layer_of_a_linear_model() -> None:
    model = SyntheticTask(model="mclr").build_model(0)
    assert _personal(model, "input") == _personal(model, "output") == OUTPUT


def test_presets_work_on_a_model_that_holds_parameters_itself() -> None:
    # The root module's prefix is "", so its own tensor names are used instead
    model = nn.Linear(3, 2)
    assert _personal(model, "output") == ("weight", "bias")


@pytest.mark.parametrize(
    ("preset", "message"),
    [
        ("head", "valid presets: none, all, output"),
        ("split-input", "private_input"),
        ("adapters", "adapters=16"),
        ("fedbn", "needs a model with normalization layers"),
    ],
)
def test_a_preset_the_model_cannot_honour_is_a_value_error(preset: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_preset(preset, DigitsTask().build_model(0))


def test_every_preset_the_config_accepts_resolves() -> None:
    model = DigitsTask(adapters=4).build_model(0)
    for preset in PRESETS:
        if preset not in ("split-input", "fedbn"):  # each needs its own kind of model
            resolve_preset(preset, model)


def test_resolve_split_prefers_patterns_then_the_preset_then_the_default() -> None:
    # Prepare
    model = DigitsTask().build_model(0)
    task_personal = ("output.*",)
    # Execute
    by_preset = resolve_split(model, task_personal, FedAltConfig(personal_preset="input"))
    by_default = resolve_split(model, task_personal, FedAltConfig())
    by_patterns = resolve_split(model, task_personal, FedAltConfig(personal=("hidden.bias",)))
    fedavg_preset = resolve_split(model, task_personal, FedAvgConfig(personal_preset="output"))
    # Assert
    assert by_preset.personal == HIDDEN
    assert by_preset.shared == OUTPUT
    assert by_default.personal == OUTPUT  # FedAlt's default is the task's personal part
    assert by_patterns.personal == ("hidden.bias",)
    assert fedavg_preset.personal == OUTPUT


def test_patterns_and_a_preset_together_are_refused() -> None:
    with pytest.raises(ValueError, match="either personal"):
        parse_algorithm_config("fedalt", {"personal": ["output.*"], "personal_preset": "output"})
    with pytest.raises(ValueError, match="personal_preset"):
        parse_algorithm_config("fedsim", {"personal_preset": "head"})
