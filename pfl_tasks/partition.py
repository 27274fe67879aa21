"""Non-IID partitioning of a pooled, labelled data set into disjoint per-device index sets."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

from pfl_tasks.base import DeviceData, PartitionSpec, Split

MIN_DEVICE_SAMPLES: Final = 2
"""Smallest device a partition may produce: one train and one test sample."""

MAX_DIRICHLET_TRIES: Final = 1000
"""How many Dirichlet draws to try before declaring the minimum device size unreachable."""

POWERLAW_SIGMA: Final = 2.0
"""Log-normal shape of the power-law sizes, as in the pFedMe generator (log-normal(0, 2))."""

MAX_GROUP_DRAWS: Final = 100_000
"""How many device-to-group assignments to draw before declaring an empty group unavoidable."""


@dataclass(frozen=True)
class Partition:
    """Disjoint per-device index sets, and what the scheme knows about each device.

    `truth` has one mapping per device (empty for schemes without ground truth); the "groups"
    scheme records each device's label group as "group".
    """

    indices: list[np.ndarray]
    truth: Sequence[dict[str, float]] = field(default_factory=tuple)


@dataclass(frozen=True)
class _Job:
    """What a scheme is handed: the (subsampled) labels, the whole pool's classes, the ask."""

    labels: np.ndarray
    classes: np.ndarray
    num_devices: int
    spec: PartitionSpec
    rng: np.random.Generator
    min_samples: int


Partitioner = Callable[[_Job], Partition]


def partition_indices(
    labels: np.ndarray,
    num_devices: int,
    spec: PartitionSpec,
    rng: np.random.Generator,
    min_samples: int = MIN_DEVICE_SAMPLES,
) -> list[np.ndarray]:
    """The index sets of `partition_labels`, for callers that need no per-device truth.

    Raises:
        ValueError: See `partition_labels`.
    """
    return partition_labels(labels, num_devices, spec, rng, min_samples).indices


def partition_labels(
    labels: np.ndarray,
    num_devices: int,
    spec: PartitionSpec,
    rng: np.random.Generator,
    min_samples: int = MIN_DEVICE_SAMPLES,
) -> Partition:
    """Split a labelled pool across devices so that experiments can dial in label heterogeneity.

    With `spec.fraction` < 1, a uniform random floor(n * fraction) of the pool is drawn first
    (FedEM's subsampling) and only it is partitioned; the class set still comes from the whole
    pool, so the scheme's class-level choices (e.g. the label groups) never depend on that draw.
    Every device receives at least `min_samples` indices, the index sets are disjoint, and each is
    sorted ascending (order carries no information; `split_device` shuffles).

    Args:
        labels: One integer label per pooled sample.
        num_devices: How many devices to create.
        spec: The scheme and its parameters (see `PartitionSpec`).
        rng: The only source of randomness, so a partition is reproducible from its seed.
        min_samples: The smallest acceptable device.

    Returns:
        One int64 index array (into `labels`) per device, and one truth mapping per device.

    Raises:
        ValueError: For an unknown scheme, invalid parameters, or a pool too small for the
            requested number of devices.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        msg = f"labels must be one-dimensional, got shape {labels.shape}"
        raise ValueError(msg)
    if num_devices < 1:
        msg = f"num_devices must be at least 1, got {num_devices}"
        raise ValueError(msg)
    if min_samples < 1:
        msg = f"min_samples must be at least 1, got {min_samples}"
        raise ValueError(msg)
    partitioner = _PARTITIONERS.get(spec.scheme)
    if partitioner is None:
        msg = (
            f"unknown partition scheme {spec.scheme!r}; "
            f"valid choices: {', '.join(sorted(_PARTITIONERS))}"
        )
        raise ValueError(msg)
    classes = np.unique(labels)
    subset = _subsample(labels.shape[0], spec.fraction, rng)
    pool = labels if subset is None else labels[subset]
    if pool.shape[0] < num_devices * min_samples:
        msg = (
            f"pool too small: {pool.shape[0]} samples (fraction {spec.fraction:g} of "
            f"{labels.shape[0]}) cannot give {num_devices} devices at least {min_samples} "
            f"samples each"
        )
        raise ValueError(msg)
    partition = partitioner(_Job(pool, classes, num_devices, spec, rng, min_samples))
    smallest = min(len(p) for p in partition.indices)
    if smallest < min_samples:
        msg = (
            f"pool too small for scheme {spec.scheme!r}: a device would get {smallest} samples "
            f"(< {min_samples}) with {num_devices} devices and {pool.shape[0]} samples; "
            f"use fewer devices, a larger fraction, or more labels_per_device (shards, powerlaw)"
        )
        raise ValueError(msg)
    parts = partition.indices if subset is None else [subset[p] for p in partition.indices]
    return Partition(
        indices=[np.sort(p).astype(np.int64, copy=False) for p in parts],
        truth=list(partition.truth) or [{} for _ in parts],
    )


def split_sizes(num_samples: int, spec: PartitionSpec) -> tuple[int, int, int]:
    """Train, validation and test counts for one device, so every device can train and be scored.

    The test split gets round(n * test_fraction) samples but at least one, validation gets
    round(n * val_fraction) but at least one when val_fraction > 0, and train keeps the rest but
    at least one. Validation is therefore empty only when val_fraction is 0 or the device has two
    samples or fewer (validation gives way first, then test, down to one sample each).

    Raises:
        ValueError: If the fractions are out of range or the device has fewer than two samples.
    """
    _check_fractions(spec)
    if num_samples < MIN_DEVICE_SAMPLES:
        msg = (
            f"a device needs at least {MIN_DEVICE_SAMPLES} samples (train + test), "
            f"got {num_samples}"
        )
        raise ValueError(msg)
    num_test = max(1, _round_half_up(num_samples * spec.test_fraction))
    num_val = max(1, _round_half_up(num_samples * spec.val_fraction)) if spec.val_fraction else 0
    num_test = min(num_test, num_samples - 1)
    num_val = min(num_val, num_samples - num_test - 1)
    return num_samples - num_val - num_test, num_val, num_test


def split_device(
    indices: np.ndarray, spec: PartitionSpec, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle one device's indices into train, validation and test sets (sizes: `split_sizes`).

    Returns:
        (train_idx, val_idx, test_idx), disjoint and covering `indices`.

    Raises:
        ValueError: See `split_sizes`.
    """
    num_train, num_val, _ = split_sizes(len(indices), spec)
    shuffled = rng.permutation(np.asarray(indices))
    return (
        shuffled[:num_train],
        shuffled[num_train : num_train + num_val],
        shuffled[num_train + num_val :],
    )


def _check_fractions(spec: PartitionSpec) -> None:
    if not 0.0 <= spec.test_fraction < 1.0 or not 0.0 <= spec.val_fraction < 1.0:
        msg = (
            f"test_fraction and val_fraction must lie in [0, 1), got "
            f"{spec.test_fraction} and {spec.val_fraction}"
        )
        raise ValueError(msg)
    if spec.test_fraction + spec.val_fraction >= 1.0:
        msg = (
            f"test_fraction + val_fraction must leave room for training, got "
            f"{spec.test_fraction} + {spec.val_fraction}"
        )
        raise ValueError(msg)


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def _subsample(num_samples: int, fraction: float, rng: np.random.Generator) -> np.ndarray | None:
    """Sorted positions of a uniform floor(n * fraction) subset, or None (draw nothing) at 1.0."""
    if not 0.0 < fraction <= 1.0:
        msg = f"fraction must lie in (0, 1], got {fraction}"
        raise ValueError(msg)
    if fraction == 1.0:
        return None
    size = math.floor(num_samples * fraction)
    return np.sort(rng.choice(num_samples, size=size, replace=False))


def _labels_per_device(job: _Job) -> int:
    k = job.spec.labels_per_device
    if not 1 <= k <= len(job.classes):
        msg = f"labels_per_device must lie in [1, {len(job.classes)}] (the class count), got {k}"
        raise ValueError(msg)
    return k


def _shuffled_by_class(job: _Job) -> list[np.ndarray]:
    return [job.rng.permutation(np.flatnonzero(job.labels == c)) for c in job.classes]


def _partition_iid(job: _Job) -> Partition:
    """Uniform shuffle cut into near-equal pieces: the homogeneous baseline."""
    return Partition(
        list(np.array_split(job.rng.permutation(job.labels.shape[0]), job.num_devices))
    )


def _partition_dirichlet(job: _Job) -> Partition:
    """Per class, cut its samples among devices by proportions ~ Dir(alpha) (NIID-Bench style).

    As in NIID-Bench (Li et al. 2022), a device already holding its fair share n / num_devices
    receives nothing more from later classes, which keeps small alpha from starving most devices.
    Draws are repeated until every device has `min_samples`; only counts are drawn per attempt, so
    retries are cheap.
    """
    if not job.spec.alpha > 0.0:
        msg = f"dirichlet alpha must be positive, got {job.spec.alpha}"
        raise ValueError(msg)
    class_sizes = np.array([np.count_nonzero(job.labels == c) for c in job.classes])
    fair_share = job.labels.shape[0] / job.num_devices
    concentration = np.full(job.num_devices, float(job.spec.alpha))
    for _ in range(MAX_DIRICHLET_TRIES):
        counts = np.zeros((len(job.classes), job.num_devices), dtype=np.int64)
        sizes = np.zeros(job.num_devices, dtype=np.int64)
        for c, class_size in enumerate(class_sizes):
            hungry = sizes < fair_share
            proportions = job.rng.dirichlet(concentration) * hungry
            if not proportions.sum() > 0.0:
                proportions = hungry.astype(np.float64)
            proportions /= proportions.sum()
            cuts = np.minimum((np.cumsum(proportions) * class_size).astype(np.int64), class_size)
            cuts[-1] = class_size
            counts[c] = np.diff(cuts, prepend=0)
            sizes += counts[c]
        if sizes.min() >= job.min_samples:
            return Partition(_hand_out(_shuffled_by_class(job), counts))
    msg = (
        f"dirichlet partition with alpha={job.spec.alpha} left a device with fewer than "
        f"{job.min_samples} samples in {MAX_DIRICHLET_TRIES} draws ({job.num_devices} devices, "
        f"{job.labels.shape[0]} samples); use a larger alpha, fewer devices, or another scheme"
    )
    raise ValueError(msg)


def _partition_shards(job: _Job) -> Partition:
    """Pathological label shards (McMahan et al. 2017), with exactly k labels per device.

    Classes are shuffled; device u holds the k consecutive classes at positions u*k .. u*k+k-1
    (mod C), so each class is held by a near-equal number of devices, and each class's shuffled
    samples are cut into near-equal shards among its holders. Unlike cutting one label-sorted
    array, no shard straddles two labels, so no device exceeds k labels. Every sample is used when
    num_devices * k >= C. Sizes are near-equal when C divides num_devices * k (e.g. 20 or 100
    devices with k = 2 on 10 classes); otherwise a class with one holder fewer gives bigger shards.
    """
    k = _labels_per_device(job)
    order = job.rng.permutation(len(job.classes))
    slot_class = order[
        (np.arange(job.num_devices)[:, None] * k + np.arange(k)[None, :]) % len(job.classes)
    ]
    return Partition(_cut_among_holders(_shuffled_by_class(job), slot_class, None))


def _partition_powerlaw(job: _Job) -> Partition:
    """Give k labels per device with log-normal sizes, after the pFedMe generator (pfedbred.md 4.1).

    Device u holds classes (u + j) mod C for j < k. Each (device, class) slot first gets
    ceil(min_samples / k) samples, then the rest of the class is shared among its slots in
    proportion to log-normal(0, 2) weights, so the whole class is used without replacement.
    """
    k = _labels_per_device(job)
    slot_class = (np.arange(job.num_devices)[:, None] + np.arange(k)[None, :]) % len(job.classes)
    weights = job.rng.lognormal(0.0, POWERLAW_SIGMA, size=slot_class.shape)
    return Partition(
        _cut_among_holders(_shuffled_by_class(job), slot_class, (weights, -(-job.min_samples // k)))
    )


def _partition_groups(job: _Job) -> Partition:
    """FedeRiCo's label-group split (federico.md 5.1, resolution steps 1, 3 and 4).

    The shuffled class ids are cut into D contiguous groups of floor(C/D) or floor(C/D) + 1
    (FedEM's iid_divide); each device draws its group uniformly at random, redrawn until every
    group has a device; each group's pooled samples are shuffled and cut into disjoint shares
    differing by at most one, handed to the group's devices in index order. A device alone in
    its group gets the whole group. Step 2 (the fraction) is `partition_labels`'s subsample.
    """
    num_groups = job.spec.groups
    if not 1 <= num_groups <= len(job.classes):
        msg = f"groups must lie in [1, {len(job.classes)}] (the class count), got {num_groups}"
        raise ValueError(msg)
    if num_groups > job.num_devices:
        msg = (
            f"groups ({num_groups}) must not exceed the devices ({job.num_devices}): each needs one"
        )
        raise ValueError(msg)
    class_groups = np.array_split(job.rng.permutation(job.classes), num_groups)
    device_group = _draw_device_groups(job.num_devices, num_groups, job.rng)
    parts: list[np.ndarray] = [np.empty(0, np.int64)] * job.num_devices
    for group, group_classes in enumerate(class_groups):
        members = np.flatnonzero(device_group == group)
        pool = job.rng.permutation(np.flatnonzero(np.isin(job.labels, group_classes)))
        for device, share in zip(members, np.array_split(pool, len(members)), strict=True):
            parts[device] = share
    return Partition(parts, [{"group": float(group)} for group in device_group])


def _draw_device_groups(num_devices: int, num_groups: int, rng: np.random.Generator) -> np.ndarray:
    """A uniform group per device, redrawn until no group is empty (federico.md 5.1 step 3)."""
    for _ in range(MAX_GROUP_DRAWS):
        device_group = rng.integers(num_groups, size=num_devices)
        if np.bincount(device_group, minlength=num_groups).all():
            return device_group
    msg = (
        f"no draw in {MAX_GROUP_DRAWS} gave each of {num_groups} groups a device "
        f"({num_devices} devices); use fewer groups or more devices"
    )
    raise ValueError(msg)


def _cut_among_holders(
    by_class: list[np.ndarray],
    slot_class: np.ndarray,
    weighting: tuple[np.ndarray, int] | None,
) -> list[np.ndarray]:
    """Give each (device, slot) a piece of its class: near-equal, or seed + weighted share."""
    num_devices = slot_class.shape[0]
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
    for c, pool in enumerate(by_class):
        devices, slots = np.nonzero(slot_class == c)
        if len(devices) == 0:
            continue
        if weighting is None:
            counts = np.full(len(devices), len(pool) // len(devices))
            counts[: len(pool) % len(devices)] += 1
        else:
            counts = _seeded_weighted_counts(len(pool), weighting[0][devices, slots], weighting[1])
        for device, piece in zip(devices, np.split(pool, np.cumsum(counts)[:-1]), strict=True):
            pieces[device].append(piece)
    return [np.concatenate(p) if p else np.empty(0, np.int64) for p in pieces]


def _seeded_weighted_counts(pool_size: int, weights: np.ndarray, seed_count: int) -> np.ndarray:
    """`seed_count` each, then the remainder in proportion to `weights` (largest remainder)."""
    spare = pool_size - seed_count * len(weights)
    if spare < 0:
        seed_count = pool_size // len(weights)
        spare = pool_size - seed_count * len(weights)
    shares = spare * weights / weights.sum()
    counts = np.floor(shares).astype(np.int64)
    leftover = spare - int(counts.sum())
    counts[np.argsort(counts - shares, kind="stable")[:leftover]] += 1
    seeded: np.ndarray = counts + seed_count
    return seeded


def _hand_out(by_class: list[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
    """Cut each class's shuffled samples contiguously by the per-device counts."""
    pieces = [
        np.split(pool, np.cumsum(class_counts)[:-1])
        for pool, class_counts in zip(by_class, counts, strict=True)
    ]
    return [np.concatenate(device_pieces) for device_pieces in zip(*pieces, strict=True)]


_PARTITIONERS: Final[dict[str, Partitioner]] = {
    "iid": _partition_iid,
    "dirichlet": _partition_dirichlet,
    "shards": _partition_shards,
    "powerlaw": _partition_powerlaw,
    "groups": _partition_groups,
}


def fleet_from_pool(
    inputs: torch.Tensor,
    labels: np.ndarray,
    targets: torch.Tensor,
    num_devices: int,
    spec: PartitionSpec,
    seed: int,
) -> list[DeviceData]:
    """Partition a pooled data set across devices by `labels`, then split each device.

    `labels` drive the partition (the class labels, or any grouping for regression targets);
    each device's truth is what the scheme records (its label "group" under "groups").

    Raises:
        ValueError: the partition cannot be made (see `partition_labels`).
    """
    partition_rng, split_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)
    )
    parts = partition_labels(labels, num_devices, spec, partition_rng)
    return [
        split_samples(inputs, targets, indices, spec, split_rng, device_index, truth)
        for device_index, (indices, truth) in enumerate(
            zip(parts.indices, parts.truth, strict=True)
        )
    ]


def split_samples(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    indices: np.ndarray,
    spec: PartitionSpec,
    rng: np.random.Generator,
    device_index: int = 0,
    truth: Mapping[str, float] | None = None,
) -> DeviceData:
    """One device's samples (`indices` into the arrays) shuffled into train, validation and test.

    Raises:
        ValueError: See `split_sizes`.
    """
    train, val, test = (torch.from_numpy(i) for i in split_device(indices, spec, rng))
    return DeviceData(
        device_index=device_index,
        train=Split(inputs[train], targets[train]),
        val=Split(inputs[val], targets[val]),
        test=Split(inputs[test], targets[test]),
        truth=dict(truth or {}),
    )
