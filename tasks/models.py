"""Pieces the built-in tasks share: seeded model construction, MLPs, option checks, losses."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional

RealBound = Literal["any", "non-negative", "positive"]


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
