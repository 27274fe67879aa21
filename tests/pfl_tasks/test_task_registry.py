"""Tests for resolving tasks by name and for the task fingerprint."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pfl_tasks.base import Task
from pfl_tasks.digits import DigitsTask
from pfl_tasks.digits_image import DigitsImageTask
from pfl_tasks.gaussian import GaussianTask
from pfl_tasks.mnist1d_task import Mnist1dTask
from pfl_tasks.registry import BUILTIN_TASKS, load_task, task_fingerprint
from pfl_tasks.sine import SineTask
from pfl_tasks.synthetic import SyntheticTask

USER_MODULE = "pfl_user_tiny_task"

USER_SOURCE = textwrap.dedent(
    '''
    """A user's task module, outside the package."""
    from __future__ import annotations

    from collections import OrderedDict

    import torch
    from torch import nn

    from pfl_tasks.base import DeviceData, PartitionSpec, Split


    class TinyTask:
        name = "tiny"
        metric_name = "mse"
        personal_patterns = ("output.*",)
        input_names = ("x",)
        output_names = ("y",)

        def __init__(self, width: int = 3) -> None:
            self.width = width

        def build_model(self, seed: int) -> nn.Module:
            return nn.Sequential(OrderedDict(output=nn.Linear(self.width, 1)))

        def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return torch.mean((outputs - targets) ** 2)

        def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
            return float(torch.sum((outputs - targets) ** 2))

        def make_fleet(
            self, num_devices: int, partition: PartitionSpec, seed: int
        ) -> list[DeviceData]:
            split = Split(torch.zeros(2, self.width), torch.zeros(2, 1))
            return [DeviceData(i, split, split, split) for i in range(num_devices)]


    def make_tiny(width: int = 5) -> TinyTask:
        return TinyTask(width=width)


    def make_tiny_anything(**options: object) -> TinyTask:
        return TinyTask()


    READY = TinyTask(width=7)
    NOT_A_TASK = 42


    def make_not_a_task() -> object:
        return object()
    '''
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / f"{USER_MODULE}.py").write_text(USER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    sys.modules.pop(USER_MODULE, None)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("digits", DigitsTask),
        ("synthetic", SyntheticTask),
        ("gaussian", GaussianTask),
        ("sine", SineTask),
        ("mnist1d", Mnist1dTask),
        ("digits-image", DigitsImageTask),
    ],
)
def test_builtins_load_by_name(name: str, cls: type) -> None:
    # Execute
    task = load_task(name)

    # Assert
    assert isinstance(task, cls)
    assert isinstance(task, Task)
    assert task.name == name
    assert BUILTIN_TASKS[name] is cls


def test_builtin_options_reach_the_constructor() -> None:
    # Execute
    task = load_task("synthetic", {"alpha": 0.5, "model": "mclr"})

    # Assert
    assert isinstance(task, SyntheticTask)
    assert task.alpha == 0.5
    assert task.model == "mclr"


def test_unknown_name_names_the_builtins() -> None:
    # Execute / Assert
    with pytest.raises(
        ValueError,
        match=r"unknown task 'mnist'.*digits, digits-image, gaussian, mnist1d, sine, synthetic",
    ):
        load_task("mnist")


def test_unknown_option_names_the_accepted_options() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=r"unknown options \['hiden'\].*accepted options: hidden"):
        load_task("digits", {"hiden": 32})


def test_invalid_option_value_is_a_value_error() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="model"):
        load_task("synthetic", {"model": "resnet"})


def test_user_class_is_instantiated_with_options(user_module: str) -> None:
    # Execute
    task = load_task(f"{user_module}:TinyTask", {"width": 4})

    # Assert
    assert isinstance(task, Task)
    assert task.name == "tiny"
    assert task.build_model(0).get_parameter("output.weight").shape[1] == 4


def test_user_factory_is_called_with_options(user_module: str) -> None:
    # Execute
    default = load_task(f"{user_module}:make_tiny")
    wide = load_task(f"{user_module}:make_tiny", {"width": 9})
    anything = load_task(f"{user_module}:make_tiny_anything", {"whatever": 1})

    # Assert
    assert default.build_model(0).get_parameter("output.weight").shape[1] == 5
    assert wide.build_model(0).get_parameter("output.weight").shape[1] == 9
    assert anything.name == "tiny"


def test_user_instance_is_returned_as_is_and_takes_no_options(user_module: str) -> None:
    # Execute
    task = load_task(f"{user_module}:READY")

    # Assert
    assert task.build_model(0).get_parameter("output.weight").shape[1] == 7
    with pytest.raises(ValueError, match="accepts no options"):
        load_task(f"{user_module}:READY", {"width": 2})


def test_user_class_rejects_unknown_options(user_module: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=r"unknown options \['depth'\].*accepted options: width"):
        load_task(f"{user_module}:TinyTask", {"depth": 2})


@pytest.mark.parametrize(
    ("attribute", "pattern"),
    [
        ("Missing", "has no attribute 'Missing'"),
        ("NOT_A_TASK", "neither a Task"),
        ("make_not_a_task", "did not produce a Task"),
    ],
)
def test_bad_user_attributes_are_value_errors(
    user_module: str, attribute: str, pattern: str
) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        load_task(f"{user_module}:{attribute}")


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("no_such_module_for_pfl:Task", "cannot import module 'no_such_module_for_pfl'"),
        (":Task", "package.module:attribute"),
        ("pfl_tasks.digits:", "package.module:attribute"),
    ],
)
def test_malformed_or_unimportable_specs_are_value_errors(name: str, pattern: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        load_task(name)


def test_fingerprint_is_stable_and_ignores_values() -> None:
    # Prepare
    task = DigitsTask()

    # Execute
    first = task_fingerprint(task, task.build_model(seed=0))
    second = task_fingerprint(task, task.build_model(seed=1))

    # Assert
    assert first == second
    assert len(first) == 64
    assert int(first, 16) >= 0


def test_fingerprint_changes_with_architecture_and_task_name() -> None:
    # Prepare
    narrow, wide = DigitsTask(hidden=32), DigitsTask(hidden=64)
    mlp, mclr = SyntheticTask(model="mlp"), SyntheticTask(model="mclr")

    # Execute
    narrow_print = task_fingerprint(narrow, narrow.build_model(0))
    wide_print = task_fingerprint(wide, wide.build_model(0))
    mlp_print = task_fingerprint(mlp, mlp.build_model(0))
    mclr_print = task_fingerprint(mlp, mclr.build_model(0))
    renamed_print = task_fingerprint(GaussianTask(), SineTask().build_model(0))
    sine_print = task_fingerprint(SineTask(), SineTask().build_model(0))

    # Assert
    assert narrow_print != wide_print
    assert mlp_print != mclr_print
    assert renamed_print != sine_print


def test_fingerprint_changes_with_dtype() -> None:
    # Prepare
    task = SineTask()

    # Execute
    single = task_fingerprint(task, task.build_model(0))
    double = task_fingerprint(task, task.build_model(0).double())

    # Assert
    assert single != double
