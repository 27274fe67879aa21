"""Aggregation math shared by several strategies, on name-keyed tensor dicts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from protocols.codec import Tensors
from protocols.privacy import clip_to_norm, update_norm


def refuse_counters(deltas: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Refuse integer tensors: counters (BatchNorm's `num_batches_tracked`) are never averaged.

    A float mean of step counts is no count, and each device's keeps to itself
    (`pfl_tasks.split.with_state_kinds` keeps every integer tensor personal).

    Raises:
        ValueError: some delta holds an integer tensor (the message names it).
    """
    for delta in deltas[:1]:  # every delta has the first one's names (checked at intake)
        counters = [name for name, value in delta.items() if not value.is_floating_point()]
        if counters:
            msg = (
                f"integer tensors are counters, never averaged: {', '.join(counters)} "
                "must stay on the devices"
            )
            raise ValueError(msg)


def weighted_mean(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> Tensors:
    """sum_i w_i delta_i / sum_i w_i per tensor (FedAvg's aggregate, McMahan et al. 2017).

    Raises:
        ValueError: no deltas, mismatched lengths, weights that do not sum to a positive number,
            or an integer tensor (`refuse_counters`).
    """
    if not deltas or len(deltas) != len(weights):
        msg = f"need one weight per delta, got {len(deltas)} deltas and {len(weights)} weights"
        raise ValueError(msg)
    refuse_counters(deltas)
    total = float(sum(weights))
    if not total > 0:
        msg = f"aggregation weights must sum to a positive number, got {total}"
        raise ValueError(msg)
    result: Tensors = {}
    for name, first in deltas[0].items():
        accumulator = torch.zeros(first.shape, dtype=torch.float64)
        for delta, weight in zip(deltas, weights, strict=True):
            accumulator.add_(delta[name], alpha=weight / total)
        result[name] = accumulator.to(first.dtype)
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

    With an even count the two middle values are averaged.

    Raises:
        ValueError: no deltas, or an integer tensor (`refuse_counters`).
    """
    return trimmed_mean(deltas, 0.5)


def trimmed_mean(deltas: Sequence[Mapping[str, torch.Tensor]], trim_fraction: float) -> Tensors:
    """The coordinate-wise beta-trimmed mean, unweighted (Yin et al. 2018).

    Per coordinate, sort the n values, drop the k = floor(trim_fraction * n) smallest and the k
    largest, and average the rest. `trim_fraction` 0 is the plain mean; 0.5 (or any k that would
    leave nothing) keeps the middle one or two values: the median.

    Raises:
        ValueError: no deltas, `trim_fraction` outside [0, 0.5], or an integer tensor.
    """
    if not deltas:
        msg = "need at least one delta"
        raise ValueError(msg)
    refuse_counters(deltas)
    if not 0 <= trim_fraction <= 0.5:
        msg = f"trim_fraction must be in [0, 0.5], got {trim_fraction}"
        raise ValueError(msg)
    count = len(deltas)
    trim = min(int(trim_fraction * count), (count - 1) // 2)
    result: Tensors = {}
    for name, first in deltas[0].items():
        stacked = torch.stack([delta[name].to(torch.float64) for delta in deltas])
        kept = stacked.sort(dim=0).values[trim : count - trim]
        result[name] = kept.mean(dim=0).to(first.dtype)
    return result


def centered_clipping(
    deltas: Sequence[Mapping[str, torch.Tensor]],
    center: Mapping[str, torch.Tensor] | None = None,
    *,
    tau: float | None = None,
    iterations: int = 1,
) -> Tensors:
    """Centered clipping (Karimireddy et al. 2021, "Learning from History"), unweighted.

    From v = `center` (the previous round's aggregate: the history; zeros when None) repeat
    `iterations` times v <- v + (1/n) sum_i clip(x_i - v, tau), where clip scales a difference
    to L2 norm at most tau over all floating tensors together. A device's pull on the result is
    at most tau / n per iteration, whatever it sends or declares. `tau` None takes, at each
    iteration, the lower median of the distances ||x_i - v||: no fixed scale to tune, and with
    fewer than half the devices lying at least one honest distance bounds every clip.

    Raises:
        ValueError: no deltas, `iterations` below 1, a `tau` that is not positive, or an
            integer tensor (`refuse_counters`).
    """
    if not deltas:
        msg = "need at least one delta"
        raise ValueError(msg)
    refuse_counters(deltas)
    if iterations < 1:
        msg = f"iterations must be at least 1, got {iterations}"
        raise ValueError(msg)
    if tau is not None and not tau > 0:
        msg = f"tau must be positive, got {tau}"
        raise ValueError(msg)
    count = len(deltas)
    names = list(deltas[0])
    points = [{name: delta[name].to(torch.float64) for name in names} for delta in deltas]
    value = {
        name: torch.zeros(deltas[0][name].shape, dtype=torch.float64)
        if center is None or name not in center
        else center[name].to(torch.float64)
        for name in names
    }
    for _ in range(iterations):
        offsets = [{name: point[name] - value[name] for name in names} for point in points]
        norms = [update_norm(offset) for offset in offsets]
        bound = tau if tau is not None else sorted(norms)[(count - 1) // 2]
        for offset, norm in zip(offsets, norms, strict=True):
            scale = min(1.0, bound / norm) if norm > 0 else 1.0
            for name in names:
                value[name] = value[name] + offset[name] * (scale / count)
    return {name: value[name].to(first.dtype) for name, first in deltas[0].items()}


def robust_combine(
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    method: str = "mean",
    trim_fraction: float = 0.1,
    clip_norm: float | None = None,
    center: Mapping[str, torch.Tensor] | None = None,
    tau: float | None = None,
    iterations: int = 1,
) -> Tensors:
    """Clip each delta to `clip_norm` (if given), then combine by `method`.

    "mean" is `weighted_mean` with `weights`; "median", "trimmed-mean" and
    "centered-clipping" (from `center`, with `tau` and `iterations`) ignore the weights, so one
    device cannot buy influence with a large sample count.

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
    if method == "centered-clipping":
        return centered_clipping(deltas, center, tau=tau, iterations=iterations)
    msg = (
        f"unknown aggregation {method!r}; expected mean, median, trimmed-mean or centered-clipping"
    )
    raise ValueError(msg)
