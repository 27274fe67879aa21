"""Resolving a task by name: a built-in, or the user's own "package.module:attribute"."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Final

from torch import nn

from pfl_tasks.base import Task
from pfl_tasks.digits import DigitsTask
from pfl_tasks.digits_image import DigitsImageTask
from pfl_tasks.gaussian import GaussianTask
from pfl_tasks.mnist1d_task import Mnist1dTask
from pfl_tasks.sine import SineTask
from pfl_tasks.synthetic import SyntheticTask

BUILTIN_TASKS: Final[dict[str, type]] = {
    task.name: task
    for task in (DigitsTask, SyntheticTask, GaussianTask, SineTask, Mnist1dTask, DigitsImageTask)
}

FINGERPRINT_VERSION: Final = "pfl-edge/task-fingerprint/1"

_TASK_MEMBERS: Final = (
    "name",
    "metric_name",
    "personal_patterns",
    "input_names",
    "output_names",
    "build_model",
    "loss",
    "metric_sum",
    "make_fleet",
)


def load_task(name: str, options: Mapping[str, object] | None = None) -> Task:
    """Turn the task named on a command line or in a config into a Task object.

    `name` is a built-in (a key of `BUILTIN_TASKS`) or "package.module:attribute",
    where the attribute is a Task class or factory (called with `options` as keyword arguments)
    or a ready Task instance (which takes no options).

    Raises:
        ValueError: For an unknown name, a module or attribute that cannot be imported, options
            the task does not accept, or an object that is not a Task.
    """
    options = dict(options or {})
    if name in BUILTIN_TASKS:
        return _check_task(_instantiate(BUILTIN_TASKS[name], options, name), name)
    if ":" not in name:
        msg = (
            f"unknown task {name!r}; valid built-ins: {', '.join(sorted(BUILTIN_TASKS))}, "
            f"or 'package.module:attribute' for your own task"
        )
        raise ValueError(msg)
    target = _import_attribute(name)
    if isinstance(target, type) or not isinstance(target, Task):
        if not callable(target):
            msg = f"{name!r} is neither a Task, a Task class nor a factory: {target!r}"
            raise ValueError(msg)
        return _check_task(_instantiate(target, options, name), name)
    if options:
        msg = f"{name!r} is a Task instance and accepts no options, got {sorted(options)}"
        raise ValueError(msg)
    return target


def offered_models(name: str) -> tuple[str, ...]:
    """The models task `name` offers through its `model` option: its `models` declaration.

    Empty for a task whose model is fixed (it declares no `models`).

    Raises:
        ValueError: For an unknown task name or one that cannot be imported.
    """
    if name in BUILTIN_TASKS:
        target: object = BUILTIN_TASKS[name]
    elif ":" in name:
        target = _import_attribute(name)
    else:
        load_task(name)  # raises the unknown-task error, naming the built-ins
        return ()
    return tuple(getattr(target, "models", ()))


def options_with_model(
    name: str, options: Mapping[str, object], model: str | None
) -> dict[str, object]:
    """Task `name`'s options with `model` (the `--model` setting) added, once checked.

    Raises:
        ValueError: The task offers no choice of model, `model` is not one it offers (the
            message lists them), or the options already name another model.
    """
    merged = dict(options)
    if model is None:
        return merged
    offered = offered_models(name)
    if not offered:
        msg = (
            f"task {name!r} offers no choice of model: its model is fixed (the task declares "
            f"no `models`); drop --model"
        )
        raise ValueError(msg)
    if model not in offered:
        msg = f"unknown model {model!r} for task {name!r}; valid models: {', '.join(offered)}"
        raise ValueError(msg)
    if merged.get("model", model) != model:
        msg = (
            f"--model {model} contradicts task option model = {merged['model']!r}: give the "
            f"model once"
        )
        raise ValueError(msg)
    merged["model"] = model
    return merged


def task_fingerprint(task: Task, model: nn.Module) -> str:
    """SHA-256 of the task name and the model's state layout, to refuse mismatched saved state.

    It covers each state_dict entry's name, shape and dtype (not values), so personal state saved
    for one architecture is never loaded into another.
    """
    layout = sorted(
        (key, list(tensor.shape), str(tensor.dtype)) for key, tensor in model.state_dict().items()
    )
    payload = json.dumps([FINGERPRINT_VERSION, task.name, layout], separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _import_attribute(spec: str) -> object:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        msg = f"task {spec!r} must have the form 'package.module:attribute'"
        raise ValueError(msg)
    module = _import_user_module(module_name, spec)
    target: object = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as error:
            msg = f"module {module_name!r} has no attribute {attribute!r} (task {spec!r})"
            raise ValueError(msg) from error
    return target


def _import_user_module(module_name: str, spec: str) -> ModuleType:
    """The user's module, found in the working directory too.

    An installed `pfl-coord` does not put the working directory on `sys.path`; it is appended
    (never prepended, so a user's file cannot shadow one of our packages) when the plain import
    fails.

    Raises:
        ValueError: the module is found nowhere, naming the working directory searched.
    """
    cwd = str(Path.cwd())
    try:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name.partition(".")[0] or cwd in sys.path:
                raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)
    except ImportError as error:
        msg = (
            f"cannot import module {module_name!r} for task {spec!r} from the installed packages "
            f"or the working directory {cwd}: {error}"
        )
        raise ValueError(msg) from error
    except Exception as error:  # the user's module failed while running: say which
        msg = f"importing {module_name!r} for task {spec!r} failed: {error!r}"
        raise ValueError(msg) from error


def _instantiate(factory: Callable[..., object], options: dict[str, object], name: str) -> object:
    """Call `factory(**options)` after checking the options against its signature.

    Checking first turns a misspelt option into a ValueError naming the accepted ones, instead of
    a TypeError from deep inside the call.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory(**options)
    try:
        signature.bind(**options)
    except TypeError as error:
        accepted = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        unknown = sorted(set(options) - set(accepted))
        problem = f"unknown options {unknown}" if unknown else str(error)
        msg = (
            f"task {name!r}: {problem}; accepted options: "
            f"{', '.join(accepted) if accepted else '(none)'}"
        )
        raise ValueError(msg) from error
    return factory(**options)


def _check_task(candidate: object, name: str) -> Task:
    missing = [member for member in _TASK_MEMBERS if not hasattr(candidate, member)]
    if missing or not isinstance(candidate, Task):
        msg = f"{name!r} did not produce a Task: missing {', '.join(missing)}"
        raise ValueError(msg)
    return candidate
