"""Tests for the non-IID partitioners and the per-device split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.base import PartitionSpec
from tasks.partition import (
    MIN_DEVICE_SAMPLES,
    partition_indices,
    split_device,
    split_sizes,
)

SCHEMES = ("iid", "dirichlet", "shards", "powerlaw")


def _balanced_labels(num_classes: int = 10, per_class: int = 180) -> np.ndarray:
    """Labels shuffled so that label-sorted order differs from index order."""
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(123).permutation(labels)


def _mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    entropies = []
    for part in parts:
        counts = np.bincount(labels[part], minlength=10)
        p = counts[counts > 0] / counts.sum()
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("num_devices", [7, 20, 100])
def test_partitions_are_disjoint_and_large_enough(scheme: str, num_devices: int) -> None:
    # Prepare
    labels = _balanced_labels()
    spec = PartitionSpec(scheme=scheme, labels_per_device=2)

    # Execute
    parts = partition_indices(labels, num_devices, spec, np.random.default_rng(0))

    # Assert
    assert len(parts) == num_devices
    combined = np.concatenate(parts)
    assert len(np.unique(combined)) == len(combined)
    assert combined.min() >= 0
    assert combined.max() < len(labels)
    assert min(len(p) for p in parts) >= MIN_DEVICE_SAMPLES
    assert all(p.dtype == np.int64 for p in parts)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_is_deterministic_in_the_generator_seed(scheme: str) -> None:
    # Prepare
    labels = _balanced_labels()
    spec = PartitionSpec(scheme=scheme)

    # Execute
    first = partition_indices(labels, 20, spec, np.random.default_rng(5))
    again = partition_indices(labels, 20, spec, np.random.default_rng(5))
    other = partition_indices(labels, 20, spec, np.random.default_rng(6))

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("scheme", ["iid", "shards"])
def test_iid_and_shards_cover_the_whole_pool(scheme: str) -> None:
    # Prepare
    labels = _balanced_labels(per_class=97)

    # Execute
    parts = partition_indices(labels, 13, PartitionSpec(scheme=scheme), np.random.default_rng(1))

    # Assert
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_iid_sizes_are_near_equal() -> None:
    # Prepare
    labels = _balanced_labels()

    # Execute
    parts = partition_indices(labels, 23, PartitionSpec(scheme="iid"), np.random.default_rng(2))

    # Assert
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_give_exactly_k_labels_and_near_equal_sizes(k: int) -> None:
    # Prepare
    labels = _balanced_labels()
    spec = PartitionSpec(scheme="shards", labels_per_device=k)

    # Execute
    parts = partition_indices(labels, 20, spec, np.random.default_rng(3))

    # Assert
    assert all(len(np.unique(labels[p])) == k for p in parts)
    sizes = np.array([len(p) for p in parts])
    assert sizes.max() <= 1.2 * sizes.min()


@pytest.mark.parametrize("k", [2, 3])
def test_powerlaw_gives_consecutive_labels_and_heavy_tailed_sizes(k: int) -> None:
    # Prepare
    labels = _balanced_labels()
    spec = PartitionSpec(scheme="powerlaw", labels_per_device=k)

    # Execute
    parts = partition_indices(labels, 40, spec, np.random.default_rng(4))

    # Assert
    for u, part in enumerate(parts):
        held = set(np.unique(labels[part]).tolist())
        assert held <= {(u + j) % 10 for j in range(k)}
    sizes = np.array([len(p) for p in parts])
    assert sizes.max() / sizes.min() > 10


def test_dirichlet_small_alpha_is_much_more_skewed_than_large_alpha() -> None:
    # Prepare
    labels = _balanced_labels()

    # Execute
    skewed = partition_indices(
        labels, 20, PartitionSpec(scheme="dirichlet", alpha=0.1), np.random.default_rng(7)
    )
    mixed = partition_indices(
        labels, 20, PartitionSpec(scheme="dirichlet", alpha=100.0), np.random.default_rng(7)
    )

    # Assert: log(10) = 2.30 is a uniform label mix.
    assert _mean_label_entropy(labels, mixed) > 2.2
    assert _mean_label_entropy(labels, skewed) < 1.2


def test_unknown_scheme_names_the_valid_choices() -> None:
    # Prepare
    spec = PartitionSpec(scheme="zipf")  # type: ignore[arg-type]

    # Execute / Assert
    with pytest.raises(ValueError, match=r"unknown partition scheme 'zipf'.*dirichlet"):
        partition_indices(_balanced_labels(), 4, spec, np.random.default_rng(0))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_too_small_pool_is_a_clear_error(scheme: str) -> None:
    # Prepare
    labels = np.arange(10) % 5

    # Execute / Assert
    with pytest.raises(ValueError, match="pool too small"):
        partition_indices(labels, 6, PartitionSpec(scheme=scheme), np.random.default_rng(0))


def test_dirichlet_gives_up_with_a_clear_error() -> None:
    # Prepare: 5 samples per device on average cannot all reach 5 under alpha = 0.01.
    labels = _balanced_labels(per_class=10)
    spec = PartitionSpec(scheme="dirichlet", alpha=0.01)

    # Execute / Assert
    with pytest.raises(ValueError, match="larger alpha"):
        partition_indices(labels, 20, spec, np.random.default_rng(0), min_samples=5)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (PartitionSpec(scheme="shards", labels_per_device=11), "labels_per_device"),
        (PartitionSpec(scheme="powerlaw", labels_per_device=0), "labels_per_device"),
        (PartitionSpec(scheme="dirichlet", alpha=0.0), "alpha"),
    ],
)
def test_invalid_parameters_are_rejected(spec: PartitionSpec, pattern: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        partition_indices(_balanced_labels(), 10, spec, np.random.default_rng(0))


def test_split_device_is_disjoint_and_covers_the_device() -> None:
    # Prepare
    indices = np.arange(100, 140)
    spec = PartitionSpec(test_fraction=0.25, val_fraction=0.1)

    # Execute
    train, val, test = split_device(indices, spec, np.random.default_rng(0))

    # Assert
    assert (len(train), len(val), len(test)) == (26, 4, 10)
    assert np.array_equal(np.sort(np.concatenate([train, val, test])), indices)


@pytest.mark.parametrize(
    ("num_samples", "expected"),
    [(2, (1, 0, 1)), (3, (1, 1, 1)), (4, (2, 1, 1)), (18, (11, 2, 5)), (90, (58, 9, 23))],
)
def test_split_sizes_keep_train_and_test_on_tiny_devices(
    num_samples: int, expected: tuple[int, int, int]
) -> None:
    # Execute
    sizes = split_sizes(num_samples, PartitionSpec(test_fraction=0.25, val_fraction=0.1))

    # Assert
    assert sizes == expected


@given(
    num_samples=st.integers(2, 5000),
    test_fraction=st.floats(0.0, 0.6),
    val_fraction=st.floats(0.0, 0.35),
)
def test_split_sizes_always_leave_train_and_test(
    num_samples: int, test_fraction: float, val_fraction: float
) -> None:
    # Execute
    spec = PartitionSpec(test_fraction=test_fraction, val_fraction=val_fraction)
    num_train, num_val, num_test = split_sizes(num_samples, spec)

    # Assert
    assert num_train >= 1
    assert num_test >= 1
    assert num_val >= 0
    assert num_train + num_val + num_test == num_samples


@pytest.mark.parametrize(
    "spec",
    [
        PartitionSpec(test_fraction=1.0),
        PartitionSpec(test_fraction=0.6, val_fraction=0.4),
        PartitionSpec(val_fraction=-0.1),
    ],
)
def test_split_sizes_reject_impossible_fractions(spec: PartitionSpec) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="fraction"):
        split_sizes(10, spec)


def test_split_sizes_reject_a_one_sample_device() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="at least 2 samples"):
        split_sizes(1, PartitionSpec())


def test_scheme_specific_shortage_is_a_clear_error() -> None:
    # Prepare: one sample of class 1 cannot be shared by the two devices that hold class 1.
    labels = np.array([0] * 29 + [1])
    spec = PartitionSpec(scheme="shards", labels_per_device=1)

    # Execute / Assert
    with pytest.raises(ValueError, match="pool too small for scheme 'shards'"):
        partition_indices(labels, 4, spec, np.random.default_rng(0))
