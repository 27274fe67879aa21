"""The personal model theta that pFedMe, pFedBreD and Ditto keep beside the shared model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from device_agent.algorithms.base import LocalContext, trainable_parameters
from device_agent.training import ModelSlots
from protocols.codec import Tensors

THETA = "theta."
"""State-name prefix of the personal model theta (one tensor per trainable parameter)."""


def model_parameters(ctx: LocalContext) -> tuple[str, ...]:
    """Every trainable parameter, shared and personal: the coordinates of w and theta."""
    return trainable_parameters(ctx.model, ctx.split.shared + ctx.split.personal)


def with_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """`tensors` renamed `prefix + name`, detached copies, ready for `LocalResult.state`."""
    return {prefix + name: value.detach().clone() for name, value in tensors.items()}


def stored(
    state: Mapping[str, torch.Tensor], prefix: str, names: tuple[str, ...]
) -> Tensors | None:
    """The tensors `prefix + name` for every name in `names`, or None if any is missing.

    A device with no (or partial, e.g. another architecture's) state starts afresh.
    """
    keys = [prefix + name for name in names]
    if not all(key in state for key in keys):
        return None
    return {name: state[key].detach().clone() for name, key in zip(names, keys, strict=True)}


def load_into(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy named tensors into the model's parameters in place."""
    ModelSlots(model).load(tensors)


def load_theta(ctx: LocalContext) -> bool:
    """Put the stored personal theta into `ctx.model` (the model the device deploys).

    Returns:
        Whether a theta was stored; without one the model keeps the received w (theta's
        starting point, pfedbred spec §2.2).
    """
    theta = stored(ctx.state, THETA, model_parameters(ctx))
    if theta is None:
        return False
    load_into(ctx.model, theta)
    return True
