"""Epsilon of DP-FTRL's tree aggregation: one Gaussian mechanism, no sampling amplification.

Every complete node of every tree is released with N(0, (zC)^2) once; together they are one
Gaussian mechanism of L2 sensitivity C sqrt(s), s from `coordinator.stages.ftrl.run_sensitivity`, so
the run after t rounds is a GaussianDpEvent of multiplier z / sqrt(s), composed by
dp-accounting's RDP and PLD accountants under add/remove-one-device (removing a device's
updates, which the announced cohort does not hide: the guarantee covers what its data
contributes, not whether it took part). The tighter figure is reported, as for DP-FedAvg.
"""

from __future__ import annotations

import functools
import math

from coordinator.stages.accountant import PLD_INTERVAL, RDP_ORDERS, DpRound, Epsilons
from coordinator.stages.ftrl import effective_multiplier, run_sensitivity


@functools.lru_cache(maxsize=512)
def gaussian_epsilons(multiplier: float, delta: float) -> Epsilons:
    """Both accountants' epsilon at `delta` of one Gaussian of this multiplier (add/remove)."""
    if multiplier <= 0:
        return Epsilons(float("inf"), float("inf"))
    if multiplier == float("inf"):
        return Epsilons(0.0, 0.0)
    import dp_accounting  # imported here, as in `coordinator.stages.accountant`
    from dp_accounting.pld import pld_privacy_accountant as pld
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    event = dp_accounting.GaussianDpEvent(multiplier)
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    renyi = rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=relation)
    renyi.compose(event)
    loss = pld.PLDAccountant(relation, value_discretization_interval=PLD_INTERVAL)
    loss.compose(event)
    return Epsilons(float(renyi.get_epsilon(delta)), float(loss.get_epsilon(delta)))


class TreeAccountant:
    """The rounds fed to the trees so far and the epsilon all their nodes spend.

    Same interface as `PrivacyAccountant`; every round must have the same multiplier (the
    tree's nodes all carry the same noise).
    """

    def __init__(self, delta: float, restart: int | None, participations: int | None) -> None:
        self.delta = delta
        self.restart = restart
        self.participations = participations
        self.rounds: list[DpRound] = []

    def epsilons(self, extra: DpRound | None = None) -> Epsilons:
        """Both accountants' epsilon so far, or after one more round `extra`."""
        rounds = [*self.rounds, *([] if extra is None else [extra])]
        if not rounds:
            return Epsilons(0.0, 0.0)
        multipliers = {r.noise_multiplier for r in rounds}
        if len(multipliers) != 1:
            msg = f"a tree's nodes all carry one noise multiplier, got {sorted(multipliers)}"
            raise ValueError(msg)
        z = effective_multiplier(multipliers.pop(), len(rounds), self.restart, self.participations)
        return gaussian_epsilons(z, self.delta)

    def epsilon(self, extra: DpRound | None = None) -> float:
        """The reported epsilon so far, or after one more round `extra`."""
        return self.epsilons(extra).tighter

    def record(self, spent: DpRound) -> Epsilons:
        """Count a round fed to the tree; the epsilons spent now."""
        self.epsilons(spent)  # refuses a round of another multiplier before counting it
        self.rounds.append(spent)
        return self.epsilons()


def tree_noise_for_epsilon(
    target_epsilon: float,
    delta: float,
    rounds: int,
    restart: int | None,
    participations: int | None,
) -> float:
    """The smallest z (to 0.1%) whose tree releases over `rounds` rounds spend at most the target.

    Raises:
        ValueError: a target or round count out of range.
    """
    if not (target_epsilon > 0 and rounds >= 1):
        msg = f"need epsilon > 0 and rounds >= 1 (got {target_epsilon}, {rounds})"
        raise ValueError(msg)
    low, high = 0.0, 1.0
    while gaussian_epsilons(high, delta).tighter > target_epsilon:
        low, high = high, high * 2
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (
            (middle, high)
            if gaussian_epsilons(middle, delta).tighter > target_epsilon
            else (low, middle)
        )
    return high * math.sqrt(run_sensitivity(rounds, restart, participations))
