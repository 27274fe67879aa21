"""How much an update trained on an older model counts in asynchronous aggregation.

The rules are FedAsync's (Xie, Koyejo and Gupta 2019, §5.2), with staleness s = the number of
aggregations between the model a device started from and the one its update is applied to:

- constant:    w(s) = 1
- polynomial:  w(s) = (1 + s)^-a               (FedBuff, Nguyen et al. 2022, uses a = 0.5)
- hinge:       w(s) = 1 if s <= b, else 1 / (a (s - b) + 1)

An update is scaled by w(s) before the strategy averages the buffer, so the model moves by
(1/K) sum_i w(s_i) delta_i for FedAvg's weights, FedBuff's server step at server rate 1. With
non-negative parameters (the only ones accepted) w(s) <= 1 for every rule, and it depends on
the staleness alone: differential privacy's bound on one device's share of an aggregation
(`PrivacyEngine.plan_aggregation`) keeps holding after the weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from coordinator.strategies.base import ReceivedUpdate

StalenessKind = Literal["constant", "polynomial", "hinge"]
_ALIASES: dict[str, StalenessKind] = {
    "constant": "constant",
    "poly": "polynomial",
    "polynomial": "polynomial",
    "hinge": "hinge",
}
_PARAMETERS: dict[StalenessKind, int] = {"constant": 0, "polynomial": 1, "hinge": 2}


@dataclass(frozen=True)
class StalenessRule:
    """One of FedAsync's staleness functions with its parameters."""

    kind: StalenessKind = "polynomial"
    a: float = 0.5
    b: float = 4.0

    def __post_init__(self) -> None:
        """Refuse parameters that could weigh an update above 1 (DP's bound rests on it)."""
        if any(not math.isfinite(v) or v < 0 for v in (self.a, self.b)):
            msg = f"staleness parameters must be finite and not negative, got {self.a}, {self.b}"
            raise ValueError(msg)

    @classmethod
    def parse(cls, text: str) -> StalenessRule:
        """`constant`, `poly[:a]` (default a 0.5) or `hinge[:a[:b]]` (defaults 10 and 4).

        Raises:
            ValueError: another name, a parameter that is not a number, or a negative one.
        """
        name, *numbers = text.strip().lower().split(":")
        kind = _ALIASES.get(name)
        if kind is None or len(numbers) > _PARAMETERS[kind]:
            msg = f"staleness {text!r}: use constant, poly[:a] or hinge[:a[:b]]"
            raise ValueError(msg)
        try:
            values = [float(n) for n in numbers]
        except ValueError:
            msg = f"staleness {text!r}: parameters must be numbers"
            raise ValueError(msg) from None
        if any(not math.isfinite(v) or v < 0 for v in values):
            msg = f"staleness {text!r}: parameters must be finite and not negative"
            raise ValueError(msg)
        if kind == "hinge":
            defaults = (10.0, 4.0)
            return cls("hinge", *values, *defaults[len(values) :])
        if kind == "polynomial":
            return cls("polynomial", values[0] if values else 0.5)
        return cls("constant")

    def weight(self, staleness: int) -> float:
        """w(s) for `staleness` aggregations behind (FedAsync §5.2)."""
        if staleness < 0:
            msg = f"staleness must not be negative, got {staleness}"
            raise ValueError(msg)
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + staleness) ** -self.a)
        if staleness <= self.b:
            return 1.0
        return 1.0 / (self.a * (staleness - self.b) + 1.0)

    def __str__(self) -> str:
        if self.kind == "constant":
            return "constant"
        if self.kind == "polynomial":
            return f"poly:{self.a:g}"
        return f"hinge:{self.a:g}:{self.b:g}"


def weigh_update(update: ReceivedUpdate, weight: float) -> ReceivedUpdate:
    """`update` with its shared delta scaled by `weight` (itself when the weight is 1)."""
    if weight == 1.0:
        return update
    scaled = {name: tensor * weight for name, tensor in update.shared_delta.items()}
    return replace(update, shared_delta=scaled)
