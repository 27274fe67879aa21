"""Aggregation math shared by several strategies, on name-keyed tensor dicts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from protocols.codec import Tensors
from protocols.privacy import clip_to_norm


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


def coordinate_median(deltas: Sequence[Mapping[str, torch.Tensor]]) -> Tensors:
    """The coordinate-wise median of the deltas, unweighted (Yin et al. 2018, "Byzantine-robust").

    With an even count the two middle values are averaged. Integer tensors are rounded.

    Raises:
        ValueError: no deltas.
    """
    return trimmed_mean(deltas, 0.5)


def trimmed_mean(deltas: Sequence[Mapping[str, torch.Tensor]], trim_fraction: float) -> Tensors:
    """The coordinate-wise beta-trimmed mean, unweighted (Yin et al. 2018).

    Per coordinate, sort the n values, drop the k = floor(trim_fraction * n) smallest and the k
    largest, and average the rest. `trim_fraction` 0 is the plain mean; 0.5 (or any k that would
    leave nothing) keeps the middle one or two values: the median.

    Raises:
        ValueError: no deltas, or `trim_fraction` outside [0, 0.5].
    """
    if not deltas:
        msg = "need at least one delta"
        raise ValueError(msg)
    if not 0 <= trim_fraction <= 0.5:
        msg = f"trim_fraction must be in [0, 0.5], got {trim_fraction}"
        raise ValueError(msg)
    count = len(deltas)
    trim = min(int(trim_fraction * count), (count - 1) // 2)
    result: Tensors = {}
    for name, first in deltas[0].items():
        stacked = torch.stack([delta[name].to(torch.float64) for delta in deltas])
        kept = stacked.sort(dim=0).values[trim : count - trim]
        value = kept.mean(dim=0)
        result[name] = (
            value.to(first.dtype) if first.is_floating_point() else value.round().to(first.dtype)
        )
    return result


def robust_combine(
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    method: str = "mean",
    trim_fraction: float = 0.1,
    clip_norm: float | None = None,
) -> Tensors:
    """Clip each delta to `clip_norm` (if given), then combine by `method`.

    "mean" is `weighted_mean` with `weights`; "median" and "trimmed-mean" are coordinate-wise
    and ignore the weights, so one device cannot buy influence with a large sample count.

    Raises:
        ValueError: an unknown method, or as the combining function.
    """
    if clip_norm is not None:
        deltas = [clip_to_norm(delta, clip_norm) for delta in deltas]
    if method == "mean":
        return weighted_mean(deltas, weights)
    if method == "median":
        return coordinate_median(deltas)
    if method == "trimmed-mean":
        return trimmed_mean(deltas, trim_fraction)
    msg = f"unknown aggregation {method!r}; expected mean, median or trimmed-mean"
    raise ValueError(msg)
