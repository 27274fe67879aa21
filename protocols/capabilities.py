"""What an algorithm's rounds share and need, declared on its config so features can ask.

Every registered algorithm states its `Capabilities` itself (the base config has none, and a
test walks the registry), so a new algorithm cannot be silently accepted by differential
privacy, secure aggregation or asynchronous rounds: `coordinator.stages.compatibility` reads
these declarations, and the reasons a run is refused are the words written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

AggregationKind = Literal["mean", "relay", "none"]
"""mean: the coordinator takes a weighted mean of the devices' shared deltas (a sum DP can clip
and noise and secure aggregation can mask); relay: it passes each device's own model to the
peers that ask for it; none: nothing leaves a device."""

SHARING: Final[dict[AggregationKind, str]] = {
    "mean": "averages the devices' shared deltas",
    "relay": "relays each device's own model to the peers that ask for it",
    "none": "shares nothing",
}
"""How each kind of aggregation is said in a refusal ("<algorithm> <sharing>: <why not>")."""


@dataclass(frozen=True)
class Capabilities:
    """An algorithm's declared capabilities; every field is stated, none defaulted."""

    aggregation: AggregationKind
    clear_scalars: str | None
    """What per-device scalars the coordinator must read in clear, and why (None: none)."""
    synchronous: str | None
    """Why its rounds must be synchronous (None: buffered asynchronous rounds work)."""

    @property
    def relays_models(self) -> bool:
        """Whether whole per-device models travel between devices."""
        return self.aggregation == "relay"


WEIGHTED_MEAN: Final = Capabilities(aggregation="mean", clear_scalars=None, synchronous=None)
"""A weighted mean of shared deltas with nothing else in clear, in any kind of round."""
