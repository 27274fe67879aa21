"""Malicious virtual devices, for simulation only: what a liar with valid credentials sends.

An `Attack` sits behind one seam of the agent: the data it trains on, the sample count it
declares, and the update it sends after honest local training. Every agent holds one; real
devices hold `HONEST`, which changes nothing. Simulation picks the malicious devices from the
seed (`AttackPlan`) and gives each a `DeviceAttack`; the coordinator runs unchanged.

The attacks (n the fleet's devices, m the attackers, x the device's honest update, mu and sigma
the coordinate-wise mean and standard deviation of the attackers' honest updates):
  sign-flip   sends -x (its own honest update, sign flipped).
  scaling     sends `strength` x (default 100).
  alie        "A little is enough" (Baruch et al. 2019): mu - z sigma; z defaults to the
              paper's z_max, Phi^-1((n - s) / n) with s = floor(n/2 + 1) - m.
  ipm         inner-product manipulation (Xie et al. 2020): -epsilon mu (epsilon = `strength`,
              default 0.1: small enough to pass for an honest update).
  label-flip  trains honestly on labels flipped y -> C - 1 - y.
  free-rider  sends a zero delta and declares `FREE_RIDER_SAMPLES` training samples (in its
              hello, updates and evaluation reports).
The coordinated attacks (alie, ipm) share their honest updates within a `Coalition`: the
attackers built in one process; each uses the latest honest update of every member (those
that trained earlier this round, the others' from their previous round).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Final, Literal, Protocol, get_args

import numpy as np
import torch

from device_agent.algorithms.base import LocalResult
from pfl_tasks.base import DeviceData, Split
from protocols.codec import Tensors

AttackName = Literal["sign-flip", "scaling", "alie", "ipm", "label-flip", "free-rider"]
ATTACKS: Final[tuple[str, ...]] = get_args(AttackName)
FREE_RIDER_SAMPLES: Final = 1_000_000
"""What a free rider declares: far above any honest device, far below the hello's bound."""
DEFAULT_STRENGTH: Final[dict[str, float]] = {"scaling": 100.0, "ipm": 0.1}


class Attack(Protocol):
    """How one device lies (the null object `HONEST` does not)."""

    def train_data(self, data: DeviceData) -> DeviceData:
        """The data the device trains on."""
        ...

    def declared_samples(self, true_count: int) -> int:
        """The training sample count it declares in its hello and updates."""
        ...

    def forge(self, result: LocalResult) -> LocalResult:
        """What it sends instead of its honestly trained `result` (personal state stays)."""
        ...


class Honest:
    """The null attack: a real device's path."""

    def train_data(self, data: DeviceData) -> DeviceData:
        """`data` itself."""
        return data

    def declared_samples(self, true_count: int) -> int:
        """The true count."""
        return true_count

    def forge(self, result: LocalResult) -> LocalResult:
        """`result` itself."""
        return result


HONEST: Final = Honest()


@dataclass
class Coalition:
    """The attackers of one process: each member's latest honest shared delta."""

    honest: dict[str, Tensors] = field(default_factory=dict)

    def share(self, device_id: str, delta: Tensors) -> list[Tensors]:
        """Record `device_id`'s honest delta; every member's latest, in member order."""
        self.honest[device_id] = {k: v.detach().clone() for k, v in delta.items()}
        return [self.honest[member] for member in sorted(self.honest)]


def alie_z(devices: int, attackers: int) -> float:
    """Baruch et al.'s z_max: the largest shift the attackers can hide among `devices`."""
    supporters = math.floor(devices / 2 + 1) - attackers
    share = (devices - supporters) / devices
    return statistics.NormalDist().inv_cdf(min(max(share, 0.5), 0.999))


def shifted_mean(deltas: list[Tensors], z: float) -> Tensors:
    """The coordinate-wise mean minus z standard deviations; counters as in the first delta."""
    result: Tensors = {}
    for name, first in deltas[0].items():
        if not first.is_floating_point():
            result[name] = first.clone()
            continue
        stacked = torch.stack([delta[name].to(torch.float64) for delta in deltas])
        mean = stacked.mean(dim=0)
        result[name] = (mean - z * stacked.std(dim=0, correction=0)).to(first.dtype)
    return result


def _scale(delta: Tensors, factor: float) -> Tensors:
    return {k: v * factor if v.is_floating_point() else v.clone() for k, v in delta.items()}


def flip_labels(split: Split, classes: int) -> Split:
    """`split` with every label y replaced by classes - 1 - y."""
    return Split(split.inputs, classes - 1 - split.targets)


@dataclass
class DeviceAttack:
    """One malicious device's attack (see the module docstring)."""

    name: AttackName
    device_id: str
    strength: float
    coalition: Coalition
    classes: int = 0
    """label-flip: the task's class count."""

    def train_data(self, data: DeviceData) -> DeviceData:
        """Labels flipped for label-flip; else `data`."""
        if self.name != "label-flip":
            return data
        return replace(data, train=flip_labels(data.train, self.classes))

    def declared_samples(self, true_count: int) -> int:
        """`FREE_RIDER_SAMPLES` for a free rider; else the true count."""
        return FREE_RIDER_SAMPLES if self.name == "free-rider" else true_count

    def forge(self, result: LocalResult) -> LocalResult:
        """The update this attack sends in place of `result`."""
        delta = result.shared_delta
        if self.name == "sign-flip":
            delta = _scale(delta, -1.0)
        elif self.name == "scaling":
            delta = _scale(delta, self.strength)
        elif self.name == "free-rider":
            delta = _scale(delta, 0.0)
        elif self.name in ("alie", "ipm"):
            group = self.coalition.share(self.device_id, delta)
            if self.name == "alie":
                delta = shifted_mean(group, self.strength)
            else:
                delta = _scale(shifted_mean(group, 0.0), -self.strength)
        return replace(
            result,
            shared_delta=delta,
            num_samples=self.declared_samples(result.num_samples),
        )


@dataclass(frozen=True)
class AttackPlan:
    """Which virtual devices lie, and how: plain data, so worker processes rebuild it."""

    name: AttackName
    malicious: frozenset[int]
    """Device indices of the attackers."""
    strength: float

    @classmethod
    def draw(
        cls, name: AttackName, fraction: float, devices: int, seed: int, strength: float | None
    ) -> AttackPlan:
        """round(fraction x devices) attackers (at least one), drawn from `seed`.

        Raises:
            ValueError: an unknown attack, or a fraction outside (0, 1).
        """
        if name not in ATTACKS:
            msg = f"unknown attack {name!r}; expected one of {', '.join(ATTACKS)}"
            raise ValueError(msg)
        if not 0 < fraction < 1:
            msg = f"the malicious fraction must lie in (0, 1), got {fraction}"
            raise ValueError(msg)
        count = max(1, round(fraction * devices))
        rng = np.random.default_rng([seed, 0xA77AC])  # apart from the run's other draws
        chosen = frozenset(int(i) for i in rng.choice(devices, size=count, replace=False))
        if strength is None:
            strength = alie_z(devices, count) if name == "alie" else DEFAULT_STRENGTH.get(name, 1.0)
        return cls(name, chosen, strength)

    def attack(self, index: int, device_id: str, coalition: Coalition, classes: int) -> Attack:
        """Device `index`'s attack (`HONEST` unless it is malicious)."""
        if index not in self.malicious:
            return HONEST
        return DeviceAttack(self.name, device_id, self.strength, coalition, classes)
