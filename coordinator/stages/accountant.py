"""Epsilon spent so far: each DP round is a subsampled Gaussian, composed by dp-accounting.

dp-accounting (Google) is the accountant of TensorFlow Privacy and TensorFlow Federated. Two of
its accountants compose the rounds and the tighter figure is reported: Renyi DP (one
computation per distinct round, then sums) and the privacy loss distribution (PLD: numerically
tight; 0.05-0.25 s per round over 100 rounds at the value discretization used here, with the
budget's look-ahead). Each round's noise may differ (under distributed noise it depends on how
many devices answered), so each round is composed as it is recorded.

Neighbour relation, per sampling:

- Poisson (`--dp-sampling poisson`): add/remove one device. Adding one moves the sum of
  clipped deltas by at most C, so the Gaussian's multiplier is z for both accountants.
- Fixed size (`--dp-sampling fixed`): replace one device (the population, hence the cohort
  size, is public; add/remove is not defined for a sample of fixed size). Replacing one moves
  the sum by up to 2C. dp-accounting's RDP accountant takes a Gaussian's multiplier relative
  to that sensitivity (its sampling-without-replacement bound, Wang, Balle and Kasiviswanathan
  2019, Theorem 27, is over replace-one neighbours): it is given z/2. Its PLD accountant under
  REPLACE_ONE doubles the sensitivity itself: it is given z. It has no event for sampling
  without replacement, so fixed-size rounds have a PLD figure only when the sample is the whole
  population (no sampling at all); otherwise the RDP figure stands alone.

A round of the distributed discrete Gaussian (`DpRound.ring`) is no Gaussian: its Renyi DP
comes from `coordinator.stages.discrete_accountant` (the sum of the devices' discrete Gaussians,
sampled by a bound that holds for any mechanism) and it has no PLD figure.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from coordinator.stages.discrete_accountant import RingRound, ring_rdp
from protocols.privacy import Sampling

if TYPE_CHECKING:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant as pld

# dp-accounting (and the scipy it loads, about a second) is imported inside the functions that
# account: a run without DP imports this module for its records and never loads the library.

LIBRARY_RDP_ORDERS: Final = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *range(11, 64),
    128,
    256,
    512,
    1024,
)
"""dp-accounting's DEFAULT_RDP_ORDERS, spelled out so that this module loads without the
library (a test holds the two equal)."""

RDP_ORDERS = tuple(sorted({*LIBRARY_RDP_ORDERS, *range(2, 64), 80, 96, 128, 192, 256, 512}))
"""The library's Renyi orders (fine below 11, where small sampling rates find their optimum)
and every integer up to 63 and beyond (exact closed form, where at large sampling rates the
fractional orders' series do not converge and count as infinite)."""

PLD_INTERVAL: Final = 1e-3
"""The PLD's value discretization. Ten times the library's default: about 50 ms per round
instead of 500 ms for 100 rounds, and epsilon within 0.05% of it (pessimistic rounding keeps
it an upper bound)."""


@dataclass(frozen=True)
class DpRound:
    """One released aggregate: its noise multiplier and how its cohort was drawn."""

    noise_multiplier: float
    population: int
    """Devices the cohort was drawn from."""
    cohort: float
    """Expected cohort (Poisson: q * population) or its fixed size."""
    ring: RingRound | None = None
    """The distributed discrete Gaussian's sum (`coordinator.stages.discrete_accountant`), whose RDP
    replaces the Gaussian's; `noise_multiplier` is then its effective multiplier 1/eps."""


@dataclass(frozen=True)
class Epsilons:
    """One guarantee by both accountants; `pld` is None where the PLD has no event for it."""

    rdp: float
    pld: float | None

    @property
    def tighter(self) -> float:
        """The figure reported: both are upper bounds, so the smaller holds."""
        return self.rdp if self.pld is None else min(self.rdp, self.pld)


def relation(sampling: Sampling) -> dp_accounting.NeighboringRelation:
    """The neighbour relation a sampling is accounted under (see the module's docstring)."""
    import dp_accounting

    if sampling == "poisson":
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dp_accounting.NeighboringRelation.REPLACE_ONE


def round_event(spent: DpRound, sampling: Sampling) -> Any:
    """The round as dp-accounting's RDP accountant takes it."""
    import dp_accounting

    if sampling == "poisson":
        gaussian = dp_accounting.GaussianDpEvent(spent.noise_multiplier)
        return dp_accounting.PoissonSampledDpEvent(_rate(spent), gaussian)
    return dp_accounting.SampledWithoutReplacementDpEvent(
        spent.population,
        min(spent.population, round(spent.cohort)),
        dp_accounting.GaussianDpEvent(spent.noise_multiplier / 2),  # replace-one: sum moves 2C
    )


def pld_event(spent: DpRound, sampling: Sampling) -> Any | None:
    """The round as dp-accounting's PLD accountant takes it (None: it has no such event)."""
    if spent.ring is not None:  # no PLD of a sum of discrete Gaussians: its RDP stands alone
        return None
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(spent.noise_multiplier)
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(_rate(spent), gaussian)
    if round(spent.cohort) >= spent.population:  # everyone: REPLACE_ONE doubles the sensitivity
        return gaussian
    return None


def _rate(spent: DpRound) -> float:
    return min(1.0, spent.cohort / spent.population)


def epsilon_of(rounds: Sequence[DpRound], sampling: Sampling, delta: float) -> float:
    """Epsilon at `delta` of releasing every round's aggregate (inf without noise)."""
    return epsilons_of(rounds, sampling, delta).tighter


def epsilons_of(rounds: Sequence[DpRound], sampling: Sampling, delta: float) -> Epsilons:
    """Both accountants' epsilon at `delta` of releasing every round's aggregate."""
    composed = _Composer(sampling)
    composed.add(rounds)
    return composed.epsilons(delta)


def rdp_epsilon_of(rounds: Sequence[DpRound], sampling: Sampling, delta: float) -> float:
    """The RDP accountant's epsilon at `delta` (inf without noise)."""
    composed = _Composer(sampling, with_pld=False)
    composed.add(rounds)
    return composed.epsilons(delta).rdp


def _grouped(events: Sequence[Any]) -> list[Any]:
    """Equal consecutive events as one self-composed event (the accountants' fast path)."""
    import dp_accounting

    grouped: list[Any] = []
    run_start = 0
    for index in range(1, len(events) + 1):
        if index == len(events) or events[index] != events[run_start]:
            count = index - run_start
            event = events[run_start]
            grouped.append(event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count))
            run_start = index
    return grouped


class _Unconverged(logging.Filter):
    """Drops the library's note that a fractional order's series did not converge.

    Such an order counts as infinite, i.e. it is left out of the minimum over orders: the
    result holds, and the note (one per order at large sampling rates) says nothing.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@functools.lru_cache(maxsize=256)
def _rdp_of(spent: DpRound, sampling: Sampling) -> np.ndarray:
    """One round's Renyi DP at every order (a run repeats its rounds: computed once each)."""
    if spent.ring is not None:
        if sampling == "poisson":
            return ring_rdp(spent.ring, _rate(spent), 1, RDP_ORDERS)
        return ring_rdp(spent.ring, 1.0, 2, RDP_ORDERS)  # replace-one, not amplified
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    accountant = rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=relation(sampling))
    library = logging.getLogger("absl")
    quiet = _Unconverged()
    library.addFilter(quiet)
    try:
        accountant.compose(round_event(spent, sampling))
    finally:
        library.removeFilter(quiet)
    return np.asarray(accountant.rdp, dtype=np.float64)


class _Composer:
    """Both accountants over the rounds added so far, each round composed once.

    Renyi DP adds up over rounds: its sum is kept. The PLD accountant composes each round's
    distribution into the run's.
    """

    def __init__(self, sampling: Sampling, *, with_pld: bool = True) -> None:
        from dp_accounting.pld import pld_privacy_accountant as pld

        self.sampling = sampling
        self.rounds = 0
        self.noiseless = False
        self.rdp = np.zeros(len(RDP_ORDERS))
        self.pld: pld.PLDAccountant | None = (
            pld.PLDAccountant(relation(sampling), value_discretization_interval=PLD_INTERVAL)
            if with_pld
            else None
        )

    def add(self, rounds: Sequence[DpRound]) -> None:
        self.rounds += len(rounds)
        self.noiseless = self.noiseless or any(r.noise_multiplier <= 0 for r in rounds)
        if self.noiseless or not rounds:
            return
        for spent in rounds:
            self.rdp = self.rdp + _rdp_of(spent, self.sampling)
        events = [pld_event(r, self.sampling) for r in rounds]
        if self.pld is None or any(e is None for e in events):
            self.pld = None
            return
        for event in _grouped(events):
            self.pld.compose(event)

    def after(self, spent: DpRound) -> _Composer:
        """A copy with one more round (this one unchanged)."""
        more = copy.deepcopy(self)
        more.add([spent])
        return more

    def epsilons(self, delta: float) -> Epsilons:
        if not self.rounds:
            return Epsilons(0.0, 0.0)
        if self.noiseless:
            return Epsilons(math.inf, math.inf)
        from dp_accounting.rdp import rdp_privacy_accountant as rdp

        tight = None if self.pld is None else float(self.pld.get_epsilon(delta))
        return Epsilons(float(rdp.compute_epsilon(RDP_ORDERS, self.rdp, delta)[0]), tight)


class PrivacyAccountant:
    """The rounds released so far and the epsilon they spend.

    Each round is composed once, when it is recorded (re-composing a run of rounds that
    differ from the start would cost one composition per round, every round); the look-ahead
    of `epsilon(extra)` is kept, since the round recorded next is usually that one.
    """

    def __init__(self, sampling: Sampling, delta: float) -> None:
        self.sampling = sampling
        self.delta = delta
        self.rounds: list[DpRound] = []
        self._composed = _Composer(sampling)
        self._ahead: tuple[DpRound, _Composer] | None = None

    def epsilons(self, extra: DpRound | None = None) -> Epsilons:
        """Both accountants' epsilon so far, or after one more round `extra`."""
        if extra is None:
            return self._composed.epsilons(self.delta)
        if self._ahead is None or self._ahead[0] != extra:
            self._ahead = (extra, self._composed.after(extra))
        return self._ahead[1].epsilons(self.delta)

    def epsilon(self, extra: DpRound | None = None) -> float:
        """The reported epsilon so far, or after one more round `extra`."""
        return self.epsilons(extra).tighter

    def record(self, spent: DpRound) -> Epsilons:
        """Count a released round; the epsilons spent now."""
        self.rounds.append(spent)
        if self._ahead is not None and self._ahead[0] == spent:
            self._composed = self._ahead[1]
        else:
            self._composed.add([spent])
        self._ahead = None
        return self.epsilons()


def noise_for_epsilon(
    target_epsilon: float, delta: float, sampling: Sampling, rate: float, rounds: int
) -> float:
    """The smallest noise multiplier (to 0.1%) whose `rounds` rounds spend at most the target.

    For planning a run at a budget, by the figure a run reports (the tighter accountant):
    `rate` is the sampling rate (the participation), and the population is taken large enough
    that it does not matter (Poisson ignores it).

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

    def rdp_spent(z: float) -> float:
        return rdp_epsilon_of([DpRound(z, population, cohort)] * rounds, sampling, delta)

    def spent(z: float) -> float:
        return epsilon_of([DpRound(z, population, cohort)] * rounds, sampling, delta)

    low, high = 0.0, 1.0
    while rdp_spent(high) > target_epsilon:  # RDP first: cheap, and enough
        low, high = high, high * 2
        if high > 1e6:
            msg = f"no noise multiplier up to 1e6 keeps {rounds} rounds within {target_epsilon}"
            raise ValueError(msg)
    high = _bisect(rdp_spent, target_epsilon, low, high)
    if pld_event(DpRound(high, population, cohort), sampling) is None:
        return high
    low = high / 2  # the PLD only lowers it, never far: no PLD of a vanishing noise
    while spent(low) <= target_epsilon:
        low, high = low / 2, low
    return _bisect(spent, target_epsilon, low, high)


def _bisect(spent: Any, target: float, low: float, high: float) -> float:
    """The smallest multiplier in (low, high] within `target`, to 0.1% (spent(high) is)."""
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > target else (low, middle)
    return high


Taken = Mapping[float, int]
"""The rounds one device took part in: how many at each noise multiplier."""


def fleet_epsilons(taken: Mapping[str, Taken], sampling: Sampling, delta: float) -> Epsilons:
    """Epsilon at `delta` against observers who know every round's cohort: the worst device's.

    Such an observer (a device of the fleet, the broker) reads every announcement, so sampling
    amplifies nothing: a device is exposed only in the rounds it took part in, each a Gaussian
    of that round's multiplier under the run's neighbour relation (replace-one: z/2 for RDP, z
    for the PLD under REPLACE_ONE, as in `round_event`). Gaussians compose to the Gaussian of
    the summed 1 / z^2 (Dong, Roth and Su 2019), whose epsilon grows with that sum: the device
    with the largest sum is the worst, and its rounds are composed by both accountants.
    """
    if not taken:
        return Epsilons(0.0, 0.0)
    worst = max(taken.values(), key=exposure)
    return _fleet_epsilons(tuple(sorted(worst.items())), sampling, delta)


def exposure(taken: Taken) -> float:
    """The sum of 1 / z^2 over a device's rounds (inf if one had no noise)."""
    return sum(count / z**2 if z > 0 else math.inf for z, count in taken.items() if count)


@functools.lru_cache(maxsize=64)
def _fleet_epsilons(
    taken: tuple[tuple[float, int], ...], sampling: Sampling, delta: float
) -> Epsilons:
    rounds = [(z, count) for z, count in taken if count]
    if not rounds:
        return Epsilons(0.0, 0.0)
    if any(z <= 0 for z, _ in rounds):
        return Epsilons(math.inf, math.inf)
    halved = 1.0 if sampling == "poisson" else 2.0  # replace-one: the sum moves 2C
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant as pld
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    renyi = rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=relation(sampling))
    tight = pld.PLDAccountant(relation(sampling), value_discretization_interval=PLD_INTERVAL)
    for z, count in rounds:
        renyi.compose(dp_accounting.GaussianDpEvent(z / halved), count)
        tight.compose(dp_accounting.GaussianDpEvent(z), count)
    return Epsilons(float(renyi.get_epsilon(delta)), float(tight.get_epsilon(delta)))


class FleetAccountant:
    """Each device's rounds as the fleet sees them, and the worst device, kept as rounds come.

    A round costs one counter and one sum per device of its cohort, and the figure is composed
    only when the worst device's rounds change (cached): cheap for fleets of thousands.
    """

    def __init__(self, sampling: Sampling, delta: float) -> None:
        self.sampling = sampling
        self.delta = delta
        self.taken: dict[str, dict[float, int]] = {}
        self._worst: str | None = None
        self._worst_exposure = 0.0

    def record(self, cohort: Sequence[str], noise_multiplier: float) -> Epsilons:
        """Count a released round for each device of its `cohort`; the worst device's epsilons."""
        for device in cohort:
            counts = self.taken.setdefault(device, {})
            counts[noise_multiplier] = counts.get(noise_multiplier, 0) + 1
            self._weigh(device)
        return self.epsilons()

    def restore(self, taken: dict[str, dict[float, int]]) -> Epsilons:
        """Continue from a checkpoint's `taken`; the worst device's epsilons."""
        self.taken = {device: dict(counts) for device, counts in taken.items()}
        self._worst, self._worst_exposure = None, 0.0
        for device in self.taken:
            self._weigh(device)
        return self.epsilons()

    def _weigh(self, device: str) -> None:
        """Make `device` the worst if its rounds now expose it more than the worst's."""
        load = exposure(self.taken[device])
        if self._worst is None or load > self._worst_exposure:
            self._worst, self._worst_exposure = device, load

    def epsilons(self) -> Epsilons:
        """Epsilon against cohort-aware observers so far (see `fleet_epsilons`)."""
        if self._worst is None:
            return Epsilons(0.0, 0.0)
        return fleet_epsilons({self._worst: self.taken[self._worst]}, self.sampling, self.delta)
