import numpy as np
import pytest
import torch

from coordinator.strategies.aggregate import apply_delta, weighted_mean


def test_weighted_mean_matches_an_independent_numpy_computation() -> None:
    # Prepare: three devices with unequal sample counts and different deltas
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(3, 4)) for _ in range(3)]
    counts = [5.0, 50.0, 500.0]
    deltas = [{"w": torch.tensor(a, dtype=torch.float32)} for a in arrays]
    # Execute
    mean = weighted_mean(deltas, counts)
    # Assert
    expected = sum(c * a for c, a in zip(counts, arrays, strict=True)) / sum(counts)
    np.testing.assert_allclose(mean["w"].numpy(), expected, rtol=1e-6)
    plain_mean = sum(arrays) / 3
    assert not np.allclose(mean["w"].numpy(), plain_mean, rtol=1e-3)


def test_integer_buffers_are_never_averaged() -> None:
    deltas = [{"count": torch.tensor(1)}, {"count": torch.tensor(4)}]
    with pytest.raises(ValueError, match="counters, never averaged: count"):
        weighted_mean(deltas, [1.0, 3.0])


@pytest.mark.parametrize(("deltas", "weights"), [([], []), ([{"w": torch.ones(1)}], [0.0])])
def test_weighted_mean_rejects_empty_or_zero_weight(deltas, weights) -> None:
    with pytest.raises(ValueError, match="weight"):
        weighted_mean(deltas, weights)


def test_apply_delta_takes_a_server_step() -> None:
    shared = {"w": torch.tensor([1.0, 2.0])}
    moved = apply_delta(shared, {"w": torch.tensor([0.5, -1.0])}, step=2.0)
    torch.testing.assert_close(moved["w"], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(shared["w"], torch.tensor([1.0, 2.0]))
