"""Epsilon spent so far: each DP round is a subsampled Gaussian, composed by dp-accounting.

dp-accounting (Google) is the accountant of TensorFlow Privacy and TensorFlow Federated; its
Renyi-DP accountant composes rounds of different noise exactly and in microseconds, which the
coordinator needs each round (a round's noise changes when devices drop out under distributed
noise). Poisson sampling is accounted as add/remove-one-device; a fixed-size uniform sample as
replace-one-device (Wang et al. 2019), the only relation that accountant supports for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from protocols.privacy import Sampling

RDP_ORDERS = (*range(2, 64), 80, 96, 128, 192, 256, 512)
"""Integer Renyi orders: their closed form is exact, where the library's fractional orders
warn that their series did not converge (and are left out anyway) at large sampling rates."""


@dataclass(frozen=True)
class DpRound:
    """One released aggregate: its noise multiplier and how its cohort was drawn."""

    noise_multiplier: float
    population: int
    """Devices the cohort was drawn from."""
    cohort: float
    """Expected cohort (Poisson: q * population) or its fixed size."""


def round_event(spent: DpRound, sampling: Sampling) -> Any:
    """The dp-accounting event of one round."""
    gaussian = dp_accounting.GaussianDpEvent(spent.noise_multiplier)
    if sampling == "poisson":
        rate = min(1.0, spent.cohort / spent.population)
        return dp_accounting.PoissonSampledDpEvent(rate, gaussian)
    return dp_accounting.SampledWithoutReplacementDpEvent(
        spent.population, round(spent.cohort), gaussian
    )


def epsilon_of(rounds: Sequence[DpRound], sampling: Sampling, delta: float) -> float:
    """Epsilon at `delta` of releasing every round's aggregate (inf without noise)."""
    if not rounds:
        return 0.0
    if any(r.noise_multiplier <= 0 for r in rounds):
        return math.inf
    relation = (
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        if sampling == "poisson"
        else dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    accountant = rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=relation)
    for event in _grouped(rounds, sampling):
        accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def _grouped(rounds: Sequence[DpRound], sampling: Sampling) -> list[Any]:
    """Equal consecutive rounds as one self-composed event (the accountant's fast path)."""
    events: list[Any] = []
    run_start = 0
    for index in range(1, len(rounds) + 1):
        if index == len(rounds) or rounds[index] != rounds[run_start]:
            event = round_event(rounds[run_start], sampling)
            count = index - run_start
            events.append(event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count))
            run_start = index
    return events


class PrivacyAccountant:
    """The rounds released so far and the epsilon they spend."""

    def __init__(self, sampling: Sampling, delta: float) -> None:
        self.sampling = sampling
        self.delta = delta
        self.rounds: list[DpRound] = []

    def epsilon(self, extra: DpRound | None = None) -> float:
        """Epsilon so far, or after one more round `extra`."""
        rounds = self.rounds if extra is None else [*self.rounds, extra]
        return epsilon_of(rounds, self.sampling, self.delta)

    def record(self, spent: DpRound) -> float:
        """Count a released round; the epsilon spent now."""
        self.rounds.append(spent)
        return self.epsilon()


def noise_for_epsilon(
    target_epsilon: float, delta: float, sampling: Sampling, rate: float, rounds: int
) -> float:
    """The smallest noise multiplier (to 0.1%) whose `rounds` rounds spend at most the target.

    For planning a run at a budget: `rate` is the sampling rate (the participation), and the
    population is taken large enough that it does not matter (Poisson ignores it).

    Raises:
        ValueError: a target, rate or round count out of range.
    """
    if not (target_epsilon > 0 and 0 < rate <= 1 and rounds >= 1):
        msg = (
            f"need epsilon > 0, 0 < rate <= 1, rounds >= 1 (got {target_epsilon}, {rate}, {rounds})"
        )
        raise ValueError(msg)
    population = 1_000_000
    cohort = rate * population

    def spent(z: float) -> float:
        return epsilon_of([DpRound(z, population, cohort)] * rounds, sampling, delta)

    low, high = 0.0, 1.0
    while spent(high) > target_epsilon:
        low, high = high, high * 2
        if high > 1e6:
            msg = f"no noise multiplier up to 1e6 keeps {rounds} rounds within {target_epsilon}"
            raise ValueError(msg)
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > target_epsilon else (low, middle)
    return high
