"""One forward pass of D stacked models, each on its own minibatch, and per-sample losses.

A stack of `nn.Linear` layers and elementwise activations (an MLP) runs as batched matrix
products (`torch.baddbmm`), which costs what one device's step costs at D times the width; any
other model runs through `torch.func.functional_call` under `torch.func.vmap`, which is general
but pays vmap's dispatch on every operation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.func import functional_call, vmap

from pfl_tasks.base import Task

Forward = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]
"""(stacked parameters by name, inputs [D, B, ...]) -> outputs [D, B, ...]."""

_ELEMENTWISE = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.ELU,
    nn.Softplus,
    nn.Identity,
)
_Layer = tuple[str, nn.Module]


def stacked_forward(model: nn.Module) -> tuple[Forward, frozenset[str]]:
    """The fastest exact way to run `model` stacked along a leading device dimension.

    Also the names of the weights it reads transposed ([D, in, out], see `FlatLayout`).
    """
    layers = _linear_stack(model, "")
    if layers is not None:
        weights = frozenset(f"{p}weight" for p, layer in layers if isinstance(layer, nn.Linear))
        return (lambda parameters, inputs: _run_layers(layers, parameters, inputs)), weights

    def one(parameters: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = functional_call(model, dict(parameters), (x,))
        return output

    return (lambda parameters, inputs: vmap(one)(dict(parameters), inputs)), frozenset()


def _linear_stack(module: nn.Module, prefix: str) -> list[_Layer] | None:
    """`module` as (parameter prefix, layer) in order, if it is Linear layers and activations."""
    if type(module) is nn.Sequential:
        layers: list[_Layer] = []
        for name, child in module.named_children():
            inner = _linear_stack(child, f"{prefix}{name}.")
            if inner is None:
                return None
            layers.extend(inner)
        return layers
    if type(module) is nn.Linear or type(module) in _ELEMENTWISE:
        return [(prefix, module)]
    if type(module) is nn.Flatten and module.start_dim == 1 and module.end_dim == -1:
        return [(prefix, module)]
    return None


def _run_layers(
    layers: list[_Layer], parameters: Mapping[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    for prefix, layer in layers:
        if isinstance(layer, nn.Linear):
            weight = parameters[f"{prefix}weight"]  # stored transposed: [D, in, out]
            flat = x.reshape(x.shape[0], -1, x.shape[-1])
            bias = parameters.get(f"{prefix}bias")
            out = (
                torch.bmm(flat, weight)
                if bias is None
                else torch.baddbmm(bias.unsqueeze(1), flat, weight)
            )
            x = out.view(*x.shape[:-1], out.shape[-1])
        elif isinstance(layer, nn.Flatten):
            x = x.flatten(2)
        else:
            x = layer(x)
    return x


def sample_losses(task: Task, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[D, B] losses, each `task.loss` of one sample (the task's loss is a batch mean).

    A task that declares `sample_losses` (per-sample losses whose mean is its `loss`) computes
    them in one call; any other task's `loss` is taken of each sample under vmap.
    """
    devices, batch = outputs.shape[:2]
    declared = getattr(task, "sample_losses", None)
    if declared is not None:
        losses: torch.Tensor = declared(outputs.flatten(0, 1), targets.flatten(0, 1))
        return losses.view(devices, batch)

    def one(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return task.loss(output.unsqueeze(0), target.unsqueeze(0))

    flat = vmap(one)(outputs.flatten(0, 1), targets.flatten(0, 1))
    return flat.view(devices, batch)
