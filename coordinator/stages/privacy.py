"""A run's differential privacy on the coordinator: who may join, what each round adds, the budget.

The strategies stay as they are: before one aggregates, each update is replaced by
(k / m) * (clip(delta_i) + xi / k), with k reporters, m the expected (or fixed) cohort and xi the
coordinator's noise (zero under device placement). A strategy's mean over k updates of weight 1
is then (sum_i clip(delta_i) + xi) / m, DP-FedAvg's estimate, and its server step (SGD, Adam,
pFedBreD's momentum) is post-processing. Algorithms whose aggregation is not such a mean are
refused with the reason their capabilities give (`coordinator.stages.compatibility`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
import torch

from coordinator.stages.accountant import DpRound, Epsilons, FleetAccountant
from coordinator.stages.discrete_accountant import RingRound
from coordinator.stages.mechanisms import mechanism, poisson_cohort
from coordinator.stages.noise_state import generator_state, restore_generator
from coordinator.strategies.base import FleetSnapshot, ReceivedUpdate
from protocols import secure_aggregation as sa
from protocols.messages import DevicePrivacy, SecureRound
from protocols.privacy import (
    PrivacySettings,
    clip_to_norm,
    next_clip_norm,
    noise_generator,
    update_noise_multiplier,
    within_fraction,
)

NOBODY: Final = "nobody-sampled"
"""The device id of the noise-only update of a round whose Poisson draw was empty."""


def privacy_engine(
    settings: PrivacySettings | None, participation: float, reproducible_seed: int | None
) -> PrivacyEngine | None:
    """The run's engine, None without DP (a simulation passes its seed, a real run None)."""
    if settings is None:
        return None
    return PrivacyEngine(settings, participation, reproducible_seed)


@dataclass(frozen=True)
class RoundNoise:
    """What one round's privacy was planned with."""

    device: DevicePrivacy
    population: int
    cohort: float
    update_multiplier: float
    indicator_std: float


class PrivacyEngine:
    """DP for one run: cohorts, what devices are told, the noise added here, the accountant."""

    def __init__(
        self, settings: PrivacySettings, participation: float, reproducible_seed: int | None
    ) -> None:
        self.settings = settings
        self.participation = participation
        self.clip_norm = settings.clip_norm
        self._generator = noise_generator(reproducible_seed)
        self.mechanism = mechanism(settings, self._generator, reproducible_seed)
        self.accountant = self.mechanism.accountant
        self.spent = Epsilons(0.0, 0.0)
        self.fleet = FleetAccountant(settings.sampling, settings.delta)
        self.spent_vs_fleet = Epsilons(0.0, 0.0)
        self._round: RoundNoise | None = None
        self._announced: tuple[str, ...] = ()
        self._ring: tuple[float, int] | None = None
        """The discrete Gaussian's grid: the last secure round's delta scale and coordinates."""
        self.buffer: int | None = None
        """Asynchronous: the updates an aggregation holds (`plan_aggregation`); None: rounds
        draw their cohorts."""

    def cohort(self, fleet: FleetSnapshot, rng: np.random.Generator) -> FleetSnapshot:
        """The fleet a round's strategy plans on (a Poisson sample online, or all of it)."""
        if self.settings.sampling == "poisson":
            return poisson_cohort(fleet, self.participation, rng)
        return self.mechanism.cohort(fleet, len(self.accountant.rounds) + 1)

    def releases_empty(self, fleet: FleetSnapshot) -> bool:
        """Whether a round that sampled nobody from `fleet` still runs (Poisson: it does).

        A Poisson draw may be empty, and it is a round like any other: the accountant counts
        it and `privatize` releases the noise alone, the noised sum of nobody's updates.
        """
        return self.settings.sampling == "poisson" and bool(fleet.online())

    def plan(self, fleet: FleetSnapshot, selected: Sequence[str]) -> DevicePrivacy:
        """This round's noise, for the `selected` devices drawn from `fleet`'s online ones.

        Raises:
            ValueError: adaptive clipping whose count noise leaves the update no budget.
        """
        population = len(fleet.online())
        cohort = (
            self.participation * population
            if self.settings.sampling == "poisson"
            else float(len(selected))
        )
        return self._plan(population, max(cohort, 1.0), selected)

    def plan_aggregation(self, buffer: int) -> DevicePrivacy:
        """The next asynchronous aggregation's noise: up to `buffer` updates, none sampled.

        Who fills a buffer is decided by the devices' timing, not by a sample the accountant
        may rely on: each aggregation is accounted as a Gaussian mechanism with no
        amplification (population = cohort = `buffer`, replace-one as fixed-size rounds), its
        noised sum divided by `buffer`. From the first call on, every round is counted so,
        the budget's look-ahead too, and the figure against the fleet is the same one.

        Raises:
            ValueError: Poisson sampling (no sample is drawn: the compatibility check refuses
                it), or adaptive clipping whose count noise leaves the update no budget.
        """
        if self.settings.sampling == "poisson":
            msg = "asynchronous aggregations draw no Poisson sample: use --dp-sampling fixed"
            raise ValueError(msg)
        if self.buffer is None:
            self.spent_vs_fleet = self.spent
        self.buffer = buffer
        return self._plan(buffer, float(buffer), ())

    def _plan(self, population: int, cohort: float, selected: Sequence[str]) -> DevicePrivacy:
        """The round's noise for a cohort of (expected) size `cohort` of `population`."""
        settings = self.settings
        z = settings.noise_multiplier
        indicator_std = settings.quantile_noise * cohort if settings.adaptive_clipping else 0.0
        update_z = update_noise_multiplier(z, indicator_std) if settings.adaptive_clipping else z
        on_device = settings.placement == "device"
        share = 1 / math.sqrt(cohort) if on_device else 0.0
        device = DevicePrivacy(
            clip_norm=self.clip_norm,
            noise_std=update_z * self.clip_norm * share,
            report_clipped=settings.adaptive_clipping,
            indicator_std=indicator_std * share,
            discrete=settings.distribution == "discrete-gaussian",
        )
        self._round = RoundNoise(device, population, cohort, update_z, indicator_std)
        self._announced = tuple(selected)
        self.mechanism.selected(len(self.accountant.rounds) + 1, selected)
        return device

    def over_budget(self, population: int) -> str:
        """Why the next round may not run ("" when it may): it would pass the target epsilon."""
        target = self.settings.target_epsilon
        if target is None:
            return ""
        if self.buffer is not None:  # asynchronous: an aggregation samples nobody
            population, cohort = self.buffer, float(self.buffer)
        else:
            cohort = max(self.participation * population, 1.0)
        planned = DpRound(self.settings.noise_multiplier, population, cohort)
        if self.settings.distribution == "discrete-gaussian":
            planned = self.shares_round(max(round(cohort), 1), population, cohort)
        after = self.accountant.epsilon(planned)
        if after <= target:
            return ""
        return (
            f"another round would spend epsilon {after:.3g} at delta {self.settings.delta:g}, "
            f"over the budget {target:g} (spent so far: {self.epsilon:.3g})"
        )

    def privatize(
        self,
        updates: Sequence[ReceivedUpdate],
        shared: Mapping[str, torch.Tensor],
        *,
        presummed: bool = False,
    ) -> list[ReceivedUpdate]:
        """The round's updates as the strategy may see them (see the module's docstring).

        `presummed`: one update holding the sum of the devices' clipped deltas (secure
        aggregation): it becomes (sum + xi) / m, and cannot be clipped again here. No update
        (nobody sampled): one update xi / m of `shared`'s shapes, the noise added here
        whatever the placement, since no device added any.
        """
        noise = self._planned()
        k = len(updates)
        central = self.settings.placement == "coordinator" or not k
        std = noise.update_multiplier * noise.device.clip_norm if central else 0.0
        xi = self.mechanism.noise.increment(shared, std)
        if not k:
            nothing = {n: (t.double() / noise.cohort).to(t.dtype) for n, t in xi.items()}
            return [ReceivedUpdate(NOBODY, 1, 0.0, nothing)]
        scale = k / noise.cohort
        private = []
        for update in updates:
            delta = update.shared_delta
            if central and not presummed:  # a device may not have clipped: do not depend on it
                delta = clip_to_norm(delta, noise.device.clip_norm)
            moved = {
                n: ((t.double() + xi[n].double() / k) * scale).to(t.dtype) for n, t in delta.items()
            }
            private.append(
                replace(update, shared_delta=moved, num_samples=1, train_loss=0.0, scalars={})
            )
        return private

    def finish(
        self, within_clip: Sequence[float | None], *, reporters: int | None = None
    ) -> dict[str, float]:
        """Account for the released round, adapt the clip; the round's privacy scalars.

        `within_clip` holds each reporter's noised bit, or (secure aggregation) their sum;
        `reporters` is how many devices answered (default: one per bit).
        """
        noise = self._planned()
        self._round = None
        k = len(within_clip) if reporters is None else reporters
        central = self.settings.placement == "coordinator" or not k  # nobody: noise added here
        spent = (
            DpRound(self.settings.noise_multiplier, noise.population, noise.cohort)
            if central
            else self.shares_round(k, noise.population, noise.cohort)  # of those who answered
        )
        scalars = self.record(spent)
        scalars["dp_clip_norm"] = noise.device.clip_norm
        if self.settings.adaptive_clipping:
            bits = [b if b is not None and math.isfinite(b) else 0.0 for b in within_clip]
            std = noise.indicator_std if central else 0.0
            # a device may lie: each bit counts at most as an honest bit plus 8 noise deviations
            honest, spread = 0.5, 8 * noise.device.indicator_std
            if len(bits) == 1 and k > 1:  # one secure sum of k centred bits
                honest, spread = 0.5 * k, spread * math.sqrt(k)
            count = sum(min(max(b, -honest - spread), honest + spread) for b in bits)
            count += std * float(torch.randn((), generator=self._generator, dtype=torch.float64))
            fraction = within_fraction(count, noise.cohort)
            self.clip_norm = next_clip_norm(
                self.clip_norm,
                fraction,
                self.settings.target_quantile,
                self.settings.clip_learning_rate,
            )
            scalars["dp_within_clip"] = fraction
        return scalars

    def ring(self, secure: SecureRound, dimension: int) -> None:
        """The grid a secure round sums `dimension` delta coordinates on (its last dealing's)."""
        self._ring = (sa.delta_scale(secure), dimension)

    def shares_round(self, devices: int, population: int, cohort: float) -> DpRound:
        """A device-noised round as counted when the shares of `devices` devices are in it.

        Each device adds 1/cohort of the planned variance: with k of them the sum holds
        k/cohort of it (a dropout lowers the noise). Under the discrete Gaussian the round is
        `coordinator.stages.discrete_accountant`'s on the secure round's grid (before any, a
        budget's look-ahead counts the shares without rounding: sensitivity C, no tau).
        """
        z = self.settings.noise_multiplier
        if self.settings.distribution == "gaussian":
            return DpRound(z * math.sqrt(devices / cohort), population, cohort)
        share = z * self.clip_norm / math.sqrt(cohort)
        if self._ring is None:
            ring = RingRound(self.clip_norm, share, devices, 0)
        else:
            ring = RingRound.of(self.clip_norm, self._ring[0], share, devices, self._ring[1])
        return DpRound(1 / ring.epsilon(), population, cohort, ring)

    def record(self, spent: DpRound) -> dict[str, float]:
        """Count one round with the accountants; the epsilons and noise it reports for it.

        Against the fleet, the round counts for every device its announcement named (those
        that did not answer too: an upper bound), at the round's multiplier.
        """
        self.spent = self.accountant.record(spent)
        if self.mechanism.secret_sampling and self.buffer is None:
            self.spent_vs_fleet = self.fleet.record(self._announced, spent.noise_multiplier)
        else:  # nothing was amplified by a sample the fleet could see through
            self.spent_vs_fleet = self.spent
        self._announced = ()
        scalars = {
            "dp_epsilon": self.epsilon,
            "dp_epsilon_vs_fleet": self.spent_vs_fleet.tighter,
            "dp_epsilon_rdp": self.spent.rdp,
            "dp_noise_multiplier": spent.noise_multiplier,
        }
        if self.spent.pld is not None:
            scalars["dp_epsilon_pld"] = self.spent.pld
        return scalars

    def state_dict(self) -> dict[str, Any]:
        """The engine's state for a checkpoint (JSON): the rounds accounted, clip, mechanism.

        With the noise stream's state, so a resumed run draws the noise the uninterrupted one
        would have (the checkpoint is the coordinator's, which central DP trusts with the sums).
        """
        return {
            "rounds": [
                [
                    r.noise_multiplier,
                    r.population,
                    r.cohort,
                    None
                    if r.ring is None
                    else [r.ring.sensitivity, r.ring.device_std, r.ring.devices, r.ring.dimension],
                ]
                for r in self.accountant.rounds
            ],
            "fleet": {d: sorted(counts.items()) for d, counts in self.fleet.taken.items()},
            "clip_norm": self.clip_norm,
            "mechanism": self.settings.mechanism,
            "generator": generator_state(self._generator),
            "ring": None if self._ring is None else list(self._ring),
            **self.mechanism.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict`'s output: the epsilons spent, the clip, the same tree.

        Raises:
            ValueError: a state of another mechanism, or not an engine's state.
        """
        if state.get("mechanism", "dp-fedavg") != self.settings.mechanism:
            msg = f"the checkpoint's DP state is of mechanism {state.get('mechanism')!r}"
            raise ValueError(msg)
        try:
            rounds = [
                DpRound(
                    float(z),
                    int(n),
                    float(m),
                    None
                    if ring is None
                    else RingRound(float(ring[0]), float(ring[1]), int(ring[2]), int(ring[3])),
                )
                for z, n, m, ring in state["rounds"]
            ]
            taken = {
                str(d): {float(z): int(c) for z, c in counts}
                for d, counts in state["fleet"].items()
            }
            clip_norm = float(state["clip_norm"])
            ring = state.get("ring")
            grid = None if ring is None else (float(ring[0]), int(ring[1]))
            generator = state.get("generator")  # absent from older checkpoints: fresh noise
            if generator is not None:
                restore_generator(self._generator, generator)
            self.mechanism.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as error:
            msg = f"not a DP engine's state: {error}"
            raise ValueError(msg) from error
        for spent in rounds:
            self.spent = self.accountant.record(spent)
        sampled = self.mechanism.secret_sampling and self.buffer is None
        self.spent_vs_fleet = self.fleet.restore(taken) if sampled else self.spent
        self.clip_norm = clip_norm
        self._ring = grid

    @property
    def epsilon(self) -> float:
        """The epsilon spent so far, by the tighter of the two accountants."""
        return self.spent.tighter

    def report(self) -> dict[str, object]:
        """The guarantee for a run's summary: epsilon at delta over the rounds released."""
        return {
            "epsilon": self.epsilon,
            "epsilon_rdp": self.spent.rdp,
            "epsilon_pld": self.spent.pld,
            "epsilon_vs_fleet": self.spent_vs_fleet.tighter,
            "delta": self.settings.delta,
            "rounds_released": len(self.accountant.rounds),
            "target_epsilon": self.settings.target_epsilon,
            "clip_norm": self.clip_norm,
            **self.settings.model_dump(
                include={
                    "noise_multiplier",
                    "placement",
                    "sampling",
                    "adaptive_clipping",
                    "distribution",
                    "mechanism",
                    "tree_restart",
                    "tree_participations",
                }
            ),
        }

    def _planned(self) -> RoundNoise:
        if self._round is None:
            msg = "no DP round planned: plan() comes before privatize() and finish()"
            raise RuntimeError(msg)
        return self._round
