"""One secure round's protocol state, filled phase by phase, and the layout its vectors have."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocols import secure_aggregation as sa
from protocols.messages import SecAggKeys, SecureRound, TensorSpec
from protocols.secure_aggregation import secure_layout

Reveals = dict[tuple[str, str], tuple[int, bytes]]
"""What one holder revealed: (dealer, "seed" or "key") -> (its Shamir point, the share)."""


@dataclass
class RoundState:
    """One round's protocol state, filled phase by phase."""

    run_id: str
    round_id: int
    secure: SecureRound
    specs: tuple[TensorSpec, ...]
    keys: dict[str, SecAggKeys]
    neighbours: dict[str, tuple[str, ...]]
    points: dict[str, int]
    commitments: dict[tuple[str, str], tuple[str, str]]
    dealers: tuple[str, ...] = ()
    survivors: tuple[str, ...] = ()
    revealed: dict[tuple[str, str], int] = field(default_factory=dict)
    """Shares accepted so far per (dealer, secret) in the unmasking."""
    short: int = 0
    """Secrets the unmasking needs that have fewer shares than their threshold yet."""
    gone: set[str] = field(default_factory=set)
    """Devices that declined or were quarantined: no later phase of the round waits for them."""
    culprits: set[str] = field(default_factory=set)
    unmasked: int = 0

    @property
    def context(self) -> bytes:
        """What binds every commitment and mask of the round to this run and round."""
        return sa.round_context(self.run_id, self.round_id)

    def threshold(self, device_id: str) -> int:
        """How many of `device_id`'s neighbours' shares rebuild one of its secrets."""
        return sa.threshold_of(len(self.neighbours[device_id]), self.secure.threshold)

    def layout(self) -> sa.Layout:
        """The layout of the round's masked vectors."""
        length = sum(int(np.prod(spec.shape)) for spec in self.specs)
        return secure_layout(self.secure, length, dp_bit=self.secure.bit_bound > 0)
