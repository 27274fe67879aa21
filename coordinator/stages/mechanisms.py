"""How a run's DP rounds are noised and accounted, and who may join them.

DP-FedAvg's fresh Gaussian noise on each round's sum (`Mechanism`, amplified by a Poisson or
fixed-size sample: `poisson_cohort` draws the former), or DP-FTRL's tree noise with its
per-tree participation limit (`TreeMechanism`). `coordinator.stages.privacy`'s engine holds one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from coordinator.engine.selection import poisson_sample
from coordinator.stages.accountant import PrivacyAccountant
from coordinator.stages.ftrl import ParticipationLimit, TreeNoise
from coordinator.stages.tree_accountant import TreeAccountant
from coordinator.strategies.base import DeviceInfo, FleetSnapshot
from protocols.codec import Tensors
from protocols.privacy import PrivacySettings, add_gaussian_noise, secrets_seed


def poisson_cohort(fleet: FleetSnapshot, rate: float, rng: np.random.Generator) -> FleetSnapshot:
    """The fleet with only a Poisson sample online: each online device kept with prob. `rate`.

    Nobody may be kept: that round releases the noise alone (`PrivacyEngine.privatize`).
    """
    online = [d.device_id for d in fleet.devices if d.online]
    kept = set(poisson_sample(online, rate, rng))
    return FleetSnapshot(
        tuple(
            DeviceInfo(d.device_id, d.num_train_samples, d.device_id in kept) for d in fleet.devices
        )
    )


class FreshNoise:
    """DP-FedAvg's noise: a new N(0, std^2) on every round's sum."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def increment(self, shapes: Mapping[str, torch.Tensor], std: float) -> Tensors:
        """N(0, std^2) in `shapes`' dtypes, drawn in name order."""
        return add_gaussian_noise(
            {n: torch.zeros_like(t) for n, t in shapes.items()}, std, self.generator
        )


class Mechanism:
    """How a run's rounds are noised and accounted: DP-FedAvg's fresh noise (this null stage).

    DP-FTRL's tree is `TreeMechanism`.
    """

    secret_sampling = True
    """Its accountant amplifies by a sample kept secret (devices see the cohorts: see
    `FleetAccountant` for the figure against them)."""

    def __init__(self, settings: PrivacySettings, generator: torch.Generator) -> None:
        self.noise: FreshNoise | TreeNoise = FreshNoise(generator)
        self.accountant: PrivacyAccountant | TreeAccountant = PrivacyAccountant(
            settings.sampling, settings.delta
        )

    def cohort(self, fleet: FleetSnapshot, round_number: int) -> FleetSnapshot:
        """The fleet a round's strategy may select from (unchanged: no rule limits it)."""
        del round_number
        return fleet

    def selected(self, round_number: int, device_ids: Sequence[str]) -> None:
        """Note a round's selected devices (nothing to note here)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs beyond the rounds accounted and the engine's generator."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict`'s output."""


class TreeMechanism(Mechanism):
    """DP-FTRL: tree noise (stages/ftrl.py), its accountant, the per-tree participation."""

    secret_sampling = False

    def __init__(self, settings: PrivacySettings, seed: int) -> None:
        restart = settings.tree_restart
        self.noise: TreeNoise = TreeNoise(seed, restart)
        self.accountant = TreeAccountant(settings.delta, restart, settings.tree_participations)
        self.limit = (
            None
            if settings.tree_participations is None
            else ParticipationLimit(settings.tree_participations, restart)
        )

    def cohort(self, fleet: FleetSnapshot, round_number: int) -> FleetSnapshot:
        """The fleet with the devices at their per-tree limit offline for this round."""
        if self.limit is None:
            return fleet
        allowed = self.limit.allowed(round_number, [d.device_id for d in fleet.devices])
        return FleetSnapshot(
            tuple(
                DeviceInfo(d.device_id, d.num_train_samples, d.online and d.device_id in allowed)
                for d in fleet.devices
            )
        )

    def selected(self, round_number: int, device_ids: Sequence[str]) -> None:
        """Count the round's selected devices against their per-tree limit."""
        if self.limit is not None:
            self.limit.count(round_number, device_ids)

    def state_dict(self) -> dict[str, Any]:
        """The tree's seed and rounds, and the current tree's participation counts."""
        joined = {} if self.limit is None else dict(self.limit.joined)
        return {"tree": self.noise.state_dict(), "joined": joined}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the same tree (`TreeNoise.resume`: nodes a lost round used drawn anew)."""
        self.noise = TreeNoise.resume(state["tree"])
        if self.limit is not None:
            self.limit.restore(state["joined"], self.noise.rounds)


def mechanism(
    settings: PrivacySettings, generator: torch.Generator, reproducible_seed: int | None
) -> Mechanism:
    """The run's mechanism; a simulation's seed makes the tree's noise reproducible.

    DP-FedAvg draws from the engine's `generator`, the stream its adaptive clipping's count
    noise also comes from: one stream, as before, never two seeded alike.
    """
    if settings.mechanism == "ftrl-tree":
        return TreeMechanism(settings, secrets_seed(reproducible_seed))
    return Mechanism(settings, generator)
