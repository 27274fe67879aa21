"""Tests for the non-IID partitioners and the per-device split."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pfl_tasks.base import PartitionScheme, PartitionSpec
from pfl_tasks.partition import (
    MIN_DEVICE_SAMPLES,
    partition_indices,
    partition_labels,
    split_device,
    split_sizes,
)

SCHEMES = ("iid", "dirichlet", "shards", "powerlaw", "groups")
# sha256 prefixes of `_digest(partition_indices(_balanced_labels(), 20, PartitionSpec(scheme=s),
# default_rng(5)))`, computed before the "groups" scheme and the groups/fraction fields existed.
DIGESTS_BEFORE_GROUPS = {
    "iid": "88356d4c0a17b87d",
    "dirichlet": "464cd981b1f12979",
    "shards": "698dc1a99b0056aa",
    "powerlaw": "a40faf13b75b5402",
}


def _balanced_labels(num_classes: int = 10, per_class: int = 180) -> np.ndarray:
    """Labels shuffled so that label-sorted order differs from index order."""
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(123).permutation(labels)


def _digest(parts: list[np.ndarray]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(np.int64(len(part)).tobytes())
        digest.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _group_classes(
    labels: np.ndarray, parts: list[np.ndarray], truth: list[dict[str, float]]
) -> dict[int, set[int]]:
    """Per recorded group, the set of labels its devices hold."""
    held: dict[int, set[int]] = {}
    for part, device_truth in zip(parts, truth, strict=True):
        held.setdefault(int(device_truth["group"]), set()).update(labels[part].tolist())
    return held


def _mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    entropies = []
    for part in parts:
        counts = np.bincount(labels[part], minlength=10)
        p = counts[counts > 0] / counts.sum()
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("num_devices", [7, 20, 100])
def test_partitions_are_disjoint_and_large_enough(
    scheme: PartitionScheme, num_devices: int
) -> None:
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
def test_partition_is_deterministic_in_the_generator_seed(scheme: PartitionScheme) -> None:
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
def test_iid_and_shards_cover_the_whole_pool(scheme: PartitionScheme) -> None:
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
def test_too_small_pool_is_a_clear_error(scheme: PartitionScheme) -> None:
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


@pytest.mark.parametrize("scheme", sorted(DIGESTS_BEFORE_GROUPS))
@pytest.mark.parametrize("new_fields", [{}, {"groups": 5, "fraction": 1.0}])
def test_existing_schemes_are_unchanged_by_the_groups_and_fraction_fields(
    scheme: str, new_fields: dict[str, float]
) -> None:
    # Prepare
    spec = PartitionSpec(scheme=scheme, **new_fields)  # type: ignore[arg-type]

    # Execute
    parts = partition_indices(_balanced_labels(), 20, spec, np.random.default_rng(5))

    # Assert
    assert _digest(parts) == DIGESTS_BEFORE_GROUPS[scheme]


@pytest.mark.parametrize(("num_groups", "sizes"), [(2, {5}), (3, {3, 4}), (4, {2, 3}), (10, {1})])
def test_groups_are_disjoint_label_sets_covering_all_classes(
    num_groups: int, sizes: set[int]
) -> None:
    # Prepare
    labels = _balanced_labels(per_class=50)
    spec = PartitionSpec(scheme="groups", groups=num_groups)

    # Execute
    partition = partition_labels(labels, 12, spec, np.random.default_rng(num_groups))

    # Assert: one group per device, every group held, class sets of floor/ceil(C/D) classes.
    held = _group_classes(labels, partition.indices, list(partition.truth))
    assert sorted(held) == list(range(num_groups))
    assert {len(classes) for classes in held.values()} == sizes
    assert sum(len(classes) for classes in held.values()) == 10
    assert set().union(*held.values()) == set(range(10))
    combined = np.concatenate(partition.indices)
    assert np.array_equal(np.sort(combined), np.arange(len(labels)))


@pytest.mark.parametrize("seed", range(20))
def test_every_group_gets_a_device_and_each_device_one_group(seed: int) -> None:
    # Prepare: 4 devices and 3 groups leave a group empty in a third of the draws.
    labels = _balanced_labels(per_class=30)
    spec = PartitionSpec(scheme="groups", groups=3)

    # Execute
    partition = partition_labels(labels, 4, spec, np.random.default_rng(seed))

    # Assert
    held = _group_classes(labels, partition.indices, list(partition.truth))
    assert sorted(held) == [0, 1, 2]
    for part, truth in zip(partition.indices, partition.truth, strict=True):
        device_classes = set(labels[part].tolist())
        owners = [g for g, classes in held.items() if device_classes <= classes]
        assert owners == [int(truth["group"])]


def test_devices_of_a_group_share_its_samples_near_equally() -> None:
    # Prepare: 7 devices over 3 groups, so some groups hold several devices of odd-sized pools.
    labels = _balanced_labels(per_class=37)
    spec = PartitionSpec(scheme="groups", groups=3)

    # Execute
    partition = partition_labels(labels, 7, spec, np.random.default_rng(11))

    # Assert
    held = _group_classes(labels, partition.indices, list(partition.truth))
    groups = np.array([int(t["group"]) for t in partition.truth])
    assert np.bincount(groups).max() > 1
    for group, classes in held.items():
        shares = [p for p, g in zip(partition.indices, groups, strict=True) if g == group]
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1
        assert sum(sizes) == int(np.isin(labels, sorted(classes)).sum())
        assert len(np.unique(np.concatenate(shares))) == sum(sizes)


def test_groups_are_deterministic_in_the_seed_including_the_truth() -> None:
    # Prepare
    labels = _balanced_labels()
    spec = PartitionSpec(scheme="groups", groups=4, fraction=0.5)

    # Execute
    first = partition_labels(labels, 9, spec, np.random.default_rng(8))
    again = partition_labels(labels, 9, spec, np.random.default_rng(8))
    other = partition_labels(labels, 9, spec, np.random.default_rng(9))

    # Assert
    assert _digest(first.indices) == _digest(again.indices)
    assert list(first.truth) == list(again.truth)
    assert _digest(first.indices) != _digest(other.indices)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fraction_partitions_a_random_subsample_of_the_pool(scheme: PartitionScheme) -> None:
    # Prepare
    labels = _balanced_labels()
    spec = PartitionSpec(scheme=scheme, fraction=0.25)

    # Execute
    parts = partition_indices(labels, 8, spec, np.random.default_rng(3))

    # Assert: iid, shards and groups hand out the whole subsample of floor(1800 * 0.25), drawn
    # from the whole pool rather than its start.
    combined = np.concatenate(parts)
    assert len(np.unique(combined)) == len(combined)
    assert len(combined) <= 450
    assert combined.max() < len(labels)
    if scheme in ("iid", "shards", "groups"):
        assert len(combined) == 450
        assert combined.max() > 1350
        assert np.bincount(labels[combined], minlength=10).min() > 0


def test_schemes_without_truth_record_an_empty_mapping_per_device() -> None:
    # Execute
    partition = partition_labels(
        _balanced_labels(), 5, PartitionSpec(scheme="shards"), np.random.default_rng(0)
    )

    # Assert
    assert list(partition.truth) == [{}] * 5


@pytest.mark.parametrize(
    ("spec", "num_devices", "pattern"),
    [
        (PartitionSpec(scheme="groups", groups=11), 20, r"groups must lie in \[1, 10\]"),
        (PartitionSpec(scheme="groups", groups=0), 20, "groups must lie"),
        (PartitionSpec(scheme="groups", groups=6), 5, "must not exceed the devices"),
        (PartitionSpec(scheme="iid", fraction=0.0), 5, "fraction must lie"),
        (PartitionSpec(scheme="groups", fraction=1.5), 5, "fraction must lie"),
        (PartitionSpec(scheme="dirichlet", fraction=float("nan")), 5, "fraction must lie"),
        (PartitionSpec(scheme="iid", fraction=0.001), 5, "pool too small"),
    ],
)
def test_invalid_groups_and_fraction_are_rejected(
    spec: PartitionSpec, num_devices: int, pattern: str
) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=pattern):
        partition_indices(_balanced_labels(), num_devices, spec, np.random.default_rng(0))
