"""The paper's personalization partitions, resolved into personal patterns for a given model.

Spec §2.1 names the partitions by role ("the input layer"); a model names its tensors. A preset
turns one into the other for the model at hand, as fnmatch patterns for `ParamSplit`:

    none         nothing personal (FedAvg's view)
    all          every tensor personal; the "shared copy" is the coordinator's global model
    output       the last module that holds parameters (`output` in the built-in MLPs)
    input        the first module that holds parameters, in registration order
    split-input  every module named `private_input`: the branch embedding a private input
                 chunk (`pfl_tasks.models.SplitInputMLP`, e.g. digits with model="split-input")
    adapters     every tensor whose name contains "adapter" (`pfl_tasks.models.insert_adapters`,
                 or a task's `adapters` option)
    fedbn        every normalization layer (BatchNorm, GroupNorm, LayerNorm, InstanceNorm): its
                 affine weight and bias and its running statistics stay on the device, all the
                 rest is shared (FedBN, Li et al. 2021)

Configs select a preset with `personal_preset`; `personal` stays for explicit patterns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, get_args

from torch import nn

from protocols.algorithms import PersonalPreset

PRESETS: Final[tuple[str, ...]] = get_args(PersonalPreset)


def resolve_preset(name: str, model: nn.Module) -> tuple[str, ...]:
    """The personal patterns preset `name` means for `model`.

    Raises:
        ValueError: unknown preset (the message names the valid ones), or a model that lacks
            the part the preset personalizes (no parameters, no `private_input`, no adapters).
    """
    resolver = _RESOLVERS.get(name)
    if resolver is None:
        msg = f"unknown personal preset {name!r}; valid presets: {', '.join(PRESETS)}"
        raise ValueError(msg)
    return resolver(model)


def _parametrized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that hold parameters themselves, in registration order."""
    modules = [
        (name, module)
        for name, module in model.named_modules()
        if next(module.parameters(recurse=False), None) is not None
    ]
    if not modules:
        msg = f"{type(model).__name__} has no parameters to personalize"
        raise ValueError(msg)
    return modules


def _module_patterns(name: str, module: nn.Module) -> tuple[str, ...]:
    """A module's prefix, or its own tensor names when it is the root (whose prefix is '')."""
    if name:
        return (name,)
    return tuple(
        tensor for tensor, _ in [*module.named_parameters(recurse=False), *module.named_buffers()]
    )


def _output(model: nn.Module) -> tuple[str, ...]:
    return _module_patterns(*_parametrized_modules(model)[-1])


def _input(model: nn.Module) -> tuple[str, ...]:
    return _module_patterns(*_parametrized_modules(model)[0])


def _split_input(model: nn.Module) -> tuple[str, ...]:
    branches = tuple(
        name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "private_input"
    )
    if not branches:
        msg = (
            "the split-input preset needs a model with a `private_input` branch for the private "
            "input chunk (e.g. pfl_tasks.models.SplitInputMLP; digits with model='split-input')"
        )
        raise ValueError(msg)
    return branches


def _adapters(model: nn.Module) -> tuple[str, ...]:
    if not any("adapter" in name for name in model.state_dict()):
        msg = (
            "the adapters preset needs a model with adapters (a task's adapters=16 option, "
            "or pfl_tasks.models.insert_adapters)"
        )
        raise ValueError(msg)
    return ("*adapter*",)


NORMALIZATION: Final = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
)
"""The layers the fedbn preset keeps personal (BatchNorm and InstanceNorm share _NormBase)."""


def _fedbn(model: nn.Module) -> tuple[str, ...]:
    layers = tuple(
        pattern
        for name, module in model.named_modules()
        if isinstance(module, NORMALIZATION)
        for pattern in _module_patterns(name, module)
    )
    if not layers:
        msg = (
            f"the fedbn preset needs a model with normalization layers (BatchNorm, GroupNorm, "
            f"LayerNorm, InstanceNorm); {type(model).__name__} has none"
        )
        raise ValueError(msg)
    return layers


_RESOLVERS: Final[dict[str, Callable[[nn.Module], tuple[str, ...]]]] = {
    "none": lambda model: (),
    "all": lambda model: ("*",),
    "output": _output,
    "input": _input,
    "split-input": _split_input,
    "adapters": _adapters,
    "fedbn": _fedbn,
}
