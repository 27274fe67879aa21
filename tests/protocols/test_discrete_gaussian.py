"""The distributed discrete Gaussian's device side: the exact sampler, conditional rounding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols.discrete_gaussian import (
    BETA,
    conditional_round,
    discrete_gaussian,
    noised_ring_values,
    rounding_bound,
)


def _pmf(values: np.ndarray, sigma: float) -> np.ndarray:
    """N_Z(0, sigma^2)'s closed form, normalised over a support wide enough to hold it all."""
    support = np.arange(-int(40 * sigma) - 40, int(40 * sigma) + 41)
    normaliser = np.exp(-(support.astype(float) ** 2) / (2 * sigma**2)).sum()
    pmf: np.ndarray = np.exp(-(values.astype(float) ** 2) / (2 * sigma**2)) / normaliser
    return pmf


@pytest.mark.parametrize("sigma", [0.6, 1.5, 4.0])
def test_the_sampler_matches_the_discrete_gaussian_pmf_on_a_grid(sigma: float) -> None:
    draws = 200_000
    samples = discrete_gaussian(sigma, draws, np.random.default_rng(7))
    assert samples.dtype == np.int64
    grid = np.arange(-int(4 * sigma) - 1, int(4 * sigma) + 2)
    expected = _pmf(grid, sigma)
    observed = np.array([(samples == y).mean() for y in grid])
    standard_error = np.sqrt(expected * (1 - expected) / draws)
    assert np.all(np.abs(observed - expected) <= 5 * standard_error + 1e-6)


@pytest.mark.parametrize("sigma", [0.6, 1.5, 4.0, 2e6])
def test_the_sampler_has_the_discrete_gaussian_variance_and_mean_zero(sigma: float) -> None:
    draws = 200_000
    samples = discrete_gaussian(sigma, draws, np.random.default_rng(11)).astype(float)
    if sigma < 100:
        support = np.arange(-int(40 * sigma) - 40, int(40 * sigma) + 41)
        variance = float((support.astype(float) ** 2 * _pmf(support, sigma)).sum())
    else:  # the continuous variance to 1e-9 and more at this width
        variance = sigma**2
    assert variance <= sigma**2 * (1 + 1e-9)  # Canonne et al.: never above sigma^2
    assert samples.var() == pytest.approx(variance, rel=5 * math.sqrt(2 / draws))
    assert abs(samples.mean()) <= 5 * math.sqrt(variance / draws)


def test_no_noise_is_zeros() -> None:
    assert not discrete_gaussian(0.0, 5, np.random.default_rng(0)).any()


def test_the_rounding_bound_is_the_papers_conditional_rounding_bound() -> None:
    # Kairouz, Liu and Steinke 2021 (granularity gamma, clip c, in the delta's units):
    # min{(c + gamma sqrt(d))^2, c^2 + gamma^2 d/4 + sqrt(2 ln(1/beta)) gamma (c + gamma sqrt(d)/2)}
    for clip, gamma, d in [(1.0, 1e-3, 1000), (10.0, 0.5, 50), (0.1, 1e-7, 10**6)]:
        first = (clip + gamma * math.sqrt(d)) ** 2
        second = (
            clip**2
            + gamma**2 * d / 4
            + math.sqrt(2 * math.log(1 / BETA)) * gamma * (clip + gamma * math.sqrt(d) / 2)
        )
        paper = math.sqrt(min(first, second))
        assert rounding_bound(clip / gamma, d) == pytest.approx(paper / gamma, rel=1e-12)


def test_conditional_rounding_is_unbiased_and_always_within_the_bound() -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(size=64)
    values *= 20 / np.linalg.norm(values)  # on the grid: a clip of 20 units
    bound = rounding_bound(20, values.size)
    draws = np.stack([conditional_round(values, bound, rng) for _ in range(4000)])
    assert draws.dtype == np.int64
    assert np.all(np.linalg.norm(draws, axis=1) <= bound)
    assert np.all(np.abs(draws - values) < 1)  # up or down to a neighbouring integer
    # conditioning on the norm may bias it, by little: well under a tenth of a grid step here
    assert np.abs(draws.mean(axis=0) - values).max() < 0.1


def test_rounding_refuses_values_beyond_the_clip_the_bound_was_made_for() -> None:
    values = np.full(16, 10.0)  # norm 40
    with pytest.raises(ValueError, match="norm bound"):
        conditional_round(values, rounding_bound(5, 16), np.random.default_rng(0))


def test_devices_ring_values_sum_to_the_sum_plus_the_planned_noise() -> None:
    rng = np.random.default_rng(5)
    devices, d, clip, scale, share = 10, 2000, 1.0, 1e4, 0.3
    deltas = rng.normal(size=(devices, d))
    deltas *= clip / np.linalg.norm(deltas, axis=1, keepdims=True)
    ring = np.stack([noised_ring_values(x, clip, scale, share, rng) for x in deltas])
    assert ring.dtype == np.int64
    error = ring.sum(axis=0) / scale - deltas.sum(axis=0)
    # the noise of the sum: 10 shares of 0.3 (plus rounding, under 1e-4 here)
    assert error.std() == pytest.approx(share * math.sqrt(devices), rel=0.05)
    assert abs(error.mean()) < 5 * share * math.sqrt(devices / d)
