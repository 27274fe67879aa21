"""The empirical privacy audit: its bound's math, and one small audit of every mechanism.

The bound is checked against closed forms (delta = 0: the binomial tail; all guesses right:
p^r) and against Theorem 3 of Steinke, Nasr and Jagielski 2023 written out directly; the
one-shot estimate's Gaussian epsilon against dp-accounting's PLD of the Gaussian mechanism.
Each mechanism runs once through the project's privacy code with 200 canaries: the lower bound
stays below the epsilon it reports; with no noise (DP-FTRL's tree, the discrete Gaussian's
ring: near none) the audit finds a large one, and a run that reports less than its noise gives
fails it. The tree's noise covariance the auditor whitens by is checked against the tree's draws.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_mechanism
from scipy import stats

from benchmarks.audit_bounds import (
    audit_lower_bound,
    epsilon_lower_bound,
    gaussian_epsilon,
    guesses,
    one_shot_estimate,
    p_value,
)
from benchmarks.privacy_audit import (
    CONFIGS,
    DELTA,
    Config,
    EngineRun,
    Mechanism,
    OutCanary,
    audit,
    dp,
    tree_covariance,
)
from coordinator.stages.ftrl import TreeNoise
from protocols.privacy import PrivacySettings, Sampling


def theorem_3(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """f(v) + 2 m delta max_i (f(v - i) - f(v)) / i, f the binomial tail, term by term."""
    p = math.exp(epsilon) / (1 + math.exp(epsilon))

    def tail(at: int) -> float:
        return sum(math.comb(r, j) * p**j * (1 - p) ** (r - j) for j in range(max(at, 0), r + 1))

    worst = max(((tail(v - i) - tail(v)) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail(v) + 2 * m * delta * worst)


@pytest.mark.parametrize(
    ("m", "r", "v", "epsilon", "delta"),
    [(100, 40, 30, 1.0, 0.0), (100, 40, 30, 1.0, 1e-3), (1000, 60, 55, 2.0, 1e-5),
     (50, 50, 26, 0.1, 1e-2), (20, 10, 10, 3.0, 1e-4)],
)  # fmt: skip
def test_p_value_is_theorem_3(m: int, r: int, v: int, epsilon: float, delta: float) -> None:
    assert p_value(m, r, v, epsilon, delta) == pytest.approx(
        theorem_3(m, r, v, epsilon, delta), rel=1e-9
    )


def test_without_delta_the_p_value_is_the_binomial_tail() -> None:
    p = 1 / (1 + math.exp(-1.5))
    assert p_value(500, 200, 150, 1.5, 0.0) == pytest.approx(stats.binom.sf(149, 200, p))


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_all_guesses_right_without_delta_solve_p_to_the_r(r: int) -> None:
    """All r guesses right: P = (e^eps / (1 + e^eps))^r = beta, so eps = logit(beta^(1/r))."""
    accuracy = 0.05 ** (1 / r)
    expected = math.log(accuracy / (1 - accuracy))
    assert epsilon_lower_bound(r, r, r, 0.0) == pytest.approx(expected, abs=1e-5)


def test_delta_and_chance_lower_the_bound() -> None:
    assert epsilon_lower_bound(1000, 100, 100, 1e-5) < epsilon_lower_bound(1000, 100, 100, 0.0)
    assert epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0  # half right: chance


def test_the_bound_is_rejected_at_it_and_not_above() -> None:
    bound = epsilon_lower_bound(1000, 200, 170, 1e-5)
    assert bound > 0
    assert (
        p_value(1000, 200, 170, bound, 1e-5) < 0.05 <= p_value(1000, 200, 170, bound + 1e-3, 1e-5)
    )


def test_guesses_take_the_extremes_and_abstain_between() -> None:
    assert guesses([0.3, -2.0, 5.0, 0.1, -0.5, 9.0], 4).tolist() == [0, -1, 1, 0, -1, 1]


def test_perfectly_separated_scores_give_the_closed_form_at_the_bonferroni_level() -> None:
    included = [True, False] * 50
    scores = [1.0 if inside else -1.0 for inside in included]
    bound, r, correct = audit_lower_bound(scores, included, 0.0, fractions=(0.5, 1.0))
    accuracy = 0.025 ** (1 / 100)  # two guess counts: each tested at 0.05 / 2
    assert (r, correct) == (100, 100)
    assert bound == pytest.approx(math.log(accuracy / (1 - accuracy)), abs=1e-5)


@pytest.mark.parametrize("mu", [0.2, 1.0, 3.0])
def test_gaussian_epsilon_is_dp_accountings(mu: float) -> None:
    """dp-accounting's exact privacy loss of the Gaussian gives delta 1e-5 at our epsilon."""
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(1 / mu, sensitivity=1.0)
    assert loss.get_delta_for_epsilon(gaussian_epsilon(mu, 1e-5)) == pytest.approx(1e-5, rel=1e-6)


def test_one_shot_estimate_recovers_a_gaussian_mechanism() -> None:
    """Scores N(mu, 1) for "in", N(0, 1) for "out": the estimate is close to eps(mu)."""
    rng = np.random.default_rng(0)
    included = rng.random(20000) < 0.5
    scores = rng.standard_normal(20000) + 2.0 * included
    assert one_shot_estimate(scores, included, 1e-5) == pytest.approx(
        gaussian_epsilon(2.0, 1e-5), rel=0.05
    )


MECHANISMS = [c for c in CONFIGS if c.claimed is None and c.run.settings.noise_multiplier >= 1]


def small(config: Config) -> Mechanism:
    """The configuration's mechanism with 20 ordinary devices (the table's has 100)."""
    return replace(config, run=replace(config.run, others=20)).mechanism


@pytest.mark.parametrize("config", MECHANISMS, ids=[" ".join(c.describe()) for c in MECHANISMS])
def test_the_audit_stays_below_the_reported_epsilon(config: Config) -> None:
    """Each reported epsilon is below 3.71, the most 200 canaries can show: the check can fail."""
    result = audit(small(config), canaries=200, dimension=2000, seed=1)
    assert result.reported < epsilon_lower_bound(200, 200, 200, DELTA, 0.05 / 6)
    assert result.guesses > 0
    assert 0 <= result.lower_bound < result.reported


def test_the_audit_catches_an_under_reported_epsilon() -> None:
    """Noise z=0.5 reported as the epsilon of z=8: the bound passes the reported epsilon."""
    (config,) = [c for c in CONFIGS if c.claimed is not None]
    result = audit(small(config), canaries=200, dimension=2000, seed=1)
    assert result.lower_bound > result.reported


@pytest.mark.parametrize(
    ("sampling", "participation", "out"),
    [("poisson", 0.5, None), ("fixed", 1.0, "opposite"), ("fixed", 1.0, "zero")],
)
def test_with_no_noise_the_audit_finds_a_large_epsilon(
    sampling: Sampling, participation: float, out: OutCanary | None
) -> None:
    """The audit has power: without noise almost every guess is right, whatever "out" means."""
    run = EngineRun(dp(0.0, sampling=sampling), participation, 10, others=20, out=out)
    result = audit(run, canaries=200, dimension=2000, seed=1)
    assert math.isinf(result.reported)
    assert result.lower_bound > 3.0
    assert result.estimate > 5.0


def test_the_audit_follows_the_noise() -> None:
    """More noise, the same run otherwise: the canaries are harder to tell apart."""
    low = audit(EngineRun(dp(0.5), 0.5, 5, others=20), canaries=200, dimension=2000, seed=2)
    high = audit(EngineRun(dp(3.0), 0.5, 5, others=20), canaries=200, dimension=2000, seed=2)
    assert high.lower_bound < low.lower_bound
    assert high.estimate < low.estimate


@pytest.mark.parametrize(
    "settings",
    [
        dp(0.2, mechanism="ftrl-tree", sampling="fixed", tree_participations=2),
        dp(0.0, placement="device", distribution="discrete-gaussian"),
    ],
    ids=["ftrl-tree", "discrete-gaussian"],
)
def test_the_audit_has_power_over_the_tree_and_the_ring(settings: PrivacySettings) -> None:
    """Near no noise the tree's releases and the ring's decoded sums give the canaries away."""
    participation = 0.2 if settings.mechanism == "ftrl-tree" else 0.5
    run = EngineRun(settings, participation, 10, others=20)
    result = audit(run, canaries=200, dimension=2000, seed=1)
    assert result.lower_bound > 3.0
    assert result.estimate > 5.0


@pytest.mark.parametrize("restart", [None, 3])
def test_tree_covariance_is_the_models_noise(restart: int | None) -> None:
    """The covariance the auditor whitens by is that of the tree's own increments, summed."""
    tree = TreeNoise(7, restart)
    shapes = {"w": torch.zeros(40_000)}
    increments = np.stack([tree.increment(shapes, 1.0)["w"].numpy() for _ in range(7)])
    measured = np.cov(np.cumsum(increments, axis=0))
    assert np.abs(measured - tree_covariance(TreeNoise(7, restart), 7)).max() < 0.1
