"""Pieces the built-in tasks share: seeded construction, MLPs, adapters, option checks, losses."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar, Final, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from pfl_tasks.base import MetricName

RealBound = Literal["any", "non-negative", "positive"]
ADAPTER_INIT_STD: Final = 0.01
ACTIVATIONS: Final = (nn.ReLU, nn.Tanh, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Sigmoid)


def build_seeded(seed: int, factory: Callable[[], nn.Module]) -> nn.Module:
    """Build a model whose initialization depends on `seed` alone, leaving global RNG untouched.

    Devices and the coordinator must agree on the initial model without sharing RNG state, and a
    caller's own random stream must not shift because a model was built.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def make_mlp(in_features: int, hidden: int, out_features: int) -> nn.Sequential:
    """One-hidden-layer MLP whose last layer is named `output`, the default personal part."""
    return nn.Sequential(
        OrderedDict(
            hidden=nn.Linear(in_features, hidden),
            act=nn.ReLU(),
            output=nn.Linear(hidden, out_features),
        )
    )


class SplitInputMLP(nn.Module):
    """An MLP whose hidden layer is two input branches, concatenated before the output layer.

    Spec §2.1 (Fig. 1c): the first `shared_features` inputs (the common chunk) go through
    `shared_input`, the rest (the private chunk) through `private_input`; the "split-input"
    preset makes `private_input` personal, so private features are embedded only on the device.
    """

    def __init__(
        self, shared_features: int, private_features: int, hidden: int, out_features: int
    ) -> None:
        super().__init__()
        self.shared_features = shared_features
        self.shared_input = nn.Linear(shared_features, hidden)
        self.private_input = nn.Linear(private_features, hidden)
        self.act = nn.ReLU()
        self.output = nn.Linear(2 * hidden, out_features)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Embed each chunk by its branch, concatenate, classify."""
        common = self.shared_input(inputs[..., : self.shared_features])
        private = self.private_input(inputs[..., self.shared_features :])
        logits: torch.Tensor = self.output(self.act(torch.cat((common, private), dim=-1)))
        return logits


class Adapter(nn.Module):
    """Residual bottleneck adapter a(x) = x + W_up ReLU(W_down x + b_down) + b_up (spec §2.2).

    It is the identity when its weights are zero.
    """

    def __init__(self, width: int, bottleneck: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The input plus the bottleneck's correction."""
        correction: torch.Tensor = self.up(functional.relu(self.down(inputs)))
        return inputs + correction


def insert_adapters(model: nn.Module, bottleneck: int, seed: int) -> nn.Sequential:
    """`model` with an `Adapter` after each hidden activation, named `<activation>_adapter`.

    Spec §2.2: bottleneck h (capped at the layer width), weights ~ N(0, 0.01^2), zero biases,
    so the model starts near its adapter-free self. The weights are one draw from `seed`, so
    every device builds the same adapters (spec §7.9); the global RNG is left untouched. The
    layers of `model` are reused, not copied.

    Raises:
        ValueError: `model` is not an nn.Sequential with a hidden activation after a Linear, or
            `bottleneck` is not a positive integer.
    """
    check_int("bottleneck", bottleneck)
    if not isinstance(model, nn.Sequential):
        msg = f"adapters go into nn.Sequential MLPs, got {type(model).__name__}"
        raise ValueError(msg)
    generator = torch.Generator().manual_seed(seed)
    children = list(model.named_children())
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    width: int | None = None
    for index, (name, module) in enumerate(children):
        layers[name] = module
        if isinstance(module, nn.Linear):
            width = module.out_features
        if isinstance(module, ACTIVATIONS) and width is not None and index < len(children) - 1:
            layers[f"{name}_adapter"] = _seeded_adapter(width, min(bottleneck, width), generator)
    if len(layers) == len(children):
        msg = "the model has no hidden activation after a Linear layer to place an adapter on"
        raise ValueError(msg)
    return nn.Sequential(layers)


def _seeded_adapter(width: int, bottleneck: int, generator: torch.Generator) -> Adapter:
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global RNG
        adapter = Adapter(width, bottleneck)
    with torch.no_grad():
        for linear in (adapter.down, adapter.up):
            shape = linear.weight.shape
            linear.weight.copy_(torch.randn(shape, generator=generator) * ADAPTER_INIT_STD)
            linear.bias.zero_()
    return adapter


def build_mlp(
    seed: int, in_features: int, hidden: int, out_features: int, adapters: int = 0
) -> nn.Module:
    """`make_mlp` seeded by `seed`, with adapters of bottleneck `adapters` unless it is 0."""
    model = build_seeded(seed, lambda: make_mlp(in_features, hidden, out_features))
    return insert_adapters(model, adapters, seed) if adapters else model


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Validate an integer task option so a bad value fails as a ValueError, not deep in torch.

    Raises:
        ValueError: If `value` is not an integer of at least `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        msg = f"{name} must be an integer >= {minimum}, got {value!r}"
        raise ValueError(msg)
    return value


def check_real(name: str, value: object, *, bound: RealBound = "non-negative") -> float:
    """Validate a real-valued task option against `bound`, as `check_int` does for integers.

    Raises:
        ValueError: If `value` is not a finite number within `bound`.
    """
    number = float("nan")
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        number = float(value)
    in_bound = {"any": True, "non-negative": number >= 0.0, "positive": number > 0.0}[bound]
    if not (np.isfinite(number) and in_bound):
        msg = f"{name} must be a finite number ({bound}), got {value!r}"
        raise ValueError(msg)
    return number


def classification_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch, from logits."""
    return functional.cross_entropy(outputs, targets)


def count_correct(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Number of correct top-1 predictions, so accuracy sums exactly across batches."""
    return float((outputs.argmax(dim=-1) == targets).sum().item())


class Classification:
    """Cross-entropy training and top-1 accuracy, shared by every classification task."""

    metric_name: ClassVar[MetricName] = "accuracy"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the batch."""
        return classification_loss(outputs, targets)

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each sample's cross-entropy, whose mean is `loss` (batched training's fast form)."""
        losses = functional.cross_entropy(outputs, targets, reduction="none")
        return losses.reshape(outputs.shape[0], -1).mean(dim=1)

    def metric_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Number of correct predictions in the batch."""
        return count_correct(outputs, targets)
