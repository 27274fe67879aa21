"""The accountant against independent computations for the same neighbour relation.

References come from benchmarks.accountant_table: dp-accounting's own events, its default Renyi
orders and its default PLD discretization (the project uses its own orders and a coarser PLD),
with the multiplier derived from what devices send; and from the Gaussian mechanism's closed
form (Balle and Wang 2018).
"""

from __future__ import annotations

import math

import pytest
from scipy import optimize, stats

from benchmarks.accountant_table import (
    CONFIGS,
    DELTA,
    Config,
    bit_sent,
    reference,
    released_multiplier,
    run_engine,
)
from coordinator.stages.accountant import DpRound, epsilons_of, noise_for_epsilon
from protocols.privacy import Sampling, within_fraction


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of a Gaussian mechanism with sensitivity / sigma = mu (Balle and Wang 2018).

    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), solved for eps.
    """

    def excess(eps: float) -> float:
        phi = stats.norm.cdf
        return float(phi(mu / 2 - eps / mu) - math.exp(eps) * phi(-mu / 2 - eps / mu) - delta)

    return float(optimize.brentq(excess, 0.0, 500.0, xtol=1e-10))


@pytest.mark.parametrize(
    ("config", "audit"),
    [
        (Config("fixed", 1.0, 6, 6, 4), 24.38),
        (Config("fixed", 1.0, 100, 10, 20), 24.89),
        (Config("fixed", 1.219, 200, 50, 30), 41.49),
    ],
)
def test_fixed_size_sampling_reports_the_replace_one_epsilon(config: Config, audit: float) -> None:
    """The audit's figures (2.3-4x what was reported) are what the project reports now."""
    expected = reference(config)
    exact = expected.rdp if expected.pld is None else min(expected.rdp, expected.pld)
    assert exact == pytest.approx(audit, abs=0.005)  # the reference reproduces the audit
    rounds = [DpRound(config.z, config.population, config.cohort)] * config.rounds
    assert epsilons_of(rounds, "fixed", DELTA).tighter == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize(("sampling", "sensitivity"), [("poisson", 1.0), ("fixed", 2.0)])
def test_full_participation_is_the_exact_gaussian_mechanism(
    sampling: Sampling, sensitivity: float
) -> None:
    """Everyone every round: T Gaussians of sensitivity C (add/remove) or 2C (replace-one)."""
    z, rounds, population = 1.5, 10, 8
    exact = gaussian_epsilon(sensitivity * math.sqrt(rounds) / z, DELTA)
    spent = epsilons_of([DpRound(z, population, population)] * rounds, sampling, DELTA)
    assert spent.pld == pytest.approx(exact, rel=0.005)
    assert spent.pld is not None
    assert spent.tighter == spent.pld < spent.rdp


@pytest.mark.parametrize("config", CONFIGS, ids=Config.label)
def test_the_project_matches_dp_accounting_for_the_same_relation(config: Config) -> None:
    """Both accountants within 1% of the references, and the tighter one reported.

    Adaptive clipping runs through the engine (its rounds account the update and the count
    together at z); the others through `epsilons_of`, as the engine's rounds are (checked
    in test_the_engine_reports_both_accountants_each_round).
    """
    if config.adaptive:
        scalars = run_engine(config)
    else:
        rounds = [DpRound(config.z, config.population, config.cohort)] * config.rounds
        spent = epsilons_of(rounds, config.sampling, DELTA)
        scalars = {"dp_epsilon": spent.tighter, "dp_epsilon_rdp": spent.rdp}
        if spent.pld is not None:
            scalars["dp_epsilon_pld"] = spent.pld
    expected = reference(config)
    assert scalars["dp_epsilon_rdp"] == pytest.approx(expected.rdp, rel=0.01)
    assert scalars.get("dp_epsilon_pld") == pytest.approx(expected.pld, rel=0.01)
    tighter = min(scalars["dp_epsilon_rdp"], scalars.get("dp_epsilon_pld", math.inf))
    assert scalars["dp_epsilon"] == tighter


def test_the_engine_reports_both_accountants_each_round() -> None:
    for rounds in (1, 3):
        scalars = run_engine(Config("poisson", 1.0, 100, 10, rounds))
        spent = epsilons_of([DpRound(1.0, 100, 10)] * rounds, "poisson", DELTA)
        assert scalars["dp_epsilon_rdp"] == pytest.approx(spent.rdp, rel=1e-9)
        assert scalars["dp_epsilon_pld"] == pytest.approx(spent.pld, rel=1e-6)
        assert scalars["dp_epsilon"] == scalars["dp_epsilon_pld"] < scalars["dp_epsilon_rdp"]


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_noise_for_epsilon_agrees_with_the_reported_epsilon(sampling: Sampling) -> None:
    target, rate, rounds, population = 4.0, 0.1, 20, 1_000_000
    z = noise_for_epsilon(target, DELTA, sampling, rate, rounds)
    spent = epsilons_of([DpRound(z, population, rate * population)] * rounds, sampling, DELTA)
    assert spent.tighter <= target
    slightly_less = [DpRound(z * 0.99, population, rate * population)] * rounds
    assert epsilons_of(slightly_less, sampling, DELTA).tighter > target


def test_adaptive_clipping_costs_what_z_does() -> None:
    """The audit's case, Poisson 20 of 100, z=1, 30 rounds: RDP 8.94 (14.9 with {0, 1} bits).

    Independently: one round releases the update sum (sensitivity C, noise z_delta C) and the
    bit sum (sensitivity: the largest |bit| a device sends, noise sigma_b) together, a Gaussian
    mechanism whose multiplier is (sum of (sensitivity / noise)^2)^(-1/2); Andrew et al.'s
    z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) holds when that is z.
    """
    config = Config("poisson", 1.0, 100, 20, 30, adaptive=True)
    assert released_multiplier(config) == pytest.approx(config.z, rel=1e-9)
    scalars = run_engine(config)
    assert scalars["dp_epsilon_rdp"] == pytest.approx(reference(config).rdp, rel=0.01)
    assert scalars["dp_epsilon_rdp"] == pytest.approx(8.94, abs=0.005)


def test_the_clip_estimate_is_the_fraction_within_from_centred_bits() -> None:
    """Noise aside, the coordinator's estimate from the bits devices send is the share within."""
    bits = [bit_sent(n, 1.0) for n in [0.5] * 15 + [3.0] * 5]
    assert within_fraction(sum(bits), len(bits)) == pytest.approx(0.75)


def test_the_spelled_out_orders_are_the_library_defaults() -> None:
    """The accountant loads without dp-accounting, so it spells the library's orders out."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    from coordinator.stages.accountant import LIBRARY_RDP_ORDERS, RDP_ORDERS

    assert list(LIBRARY_RDP_ORDERS) == list(rdp.DEFAULT_RDP_ORDERS)
    assert set(rdp.DEFAULT_RDP_ORDERS) <= set(RDP_ORDERS)
