"""Aggregation math shared by several strategies, on name-keyed tensor dicts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Tensors = dict[str, torch.Tensor]


def weighted_mean(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> Tensors:
    """sum_i w_i delta_i / sum_i w_i per tensor (FedAvg's aggregate, McMahan et al. 2017).

    Integer tensors (e.g. BatchNorm's batch counter) are averaged in float64 and rounded.

    Raises:
        ValueError: no deltas, mismatched lengths, or weights that do not sum to a positive number.
    """
    if not deltas or len(deltas) != len(weights):
        msg = f"need one weight per delta, got {len(deltas)} deltas and {len(weights)} weights"
        raise ValueError(msg)
    total = float(sum(weights))
    if not total > 0:
        msg = f"aggregation weights must sum to a positive number, got {total}"
        raise ValueError(msg)
    result: Tensors = {}
    for name, first in deltas[0].items():
        accumulator = torch.zeros(first.shape, dtype=torch.float64)
        for delta, weight in zip(deltas, weights, strict=True):
            accumulator.add_(delta[name], alpha=weight / total)
        result[name] = (
            accumulator.to(first.dtype)
            if first.is_floating_point()
            else accumulator.round().to(first.dtype)
        )
    return result


def apply_delta(
    shared: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor], step: float = 1.0
) -> Tensors:
    """Shared + step * delta per tensor: a server SGD step on the pseudo-gradient -delta."""
    result: Tensors = {}
    for name, value in shared.items():
        moved = value.to(torch.float64) + step * delta[name].to(torch.float64)
        result[name] = (
            moved.to(value.dtype) if value.is_floating_point() else moved.round().to(value.dtype)
        )
    return result
