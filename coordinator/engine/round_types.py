"""What the round engine is configured with and what it records of each round."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from coordinator.engine.downlink import DownlinkCodec
from coordinator.stages.aggregate_guard import GuardSettings
from protocols import topics
from protocols.codec import encode_frame
from protocols.compression import NO_COMPRESSION
from protocols.messages import Compression, CoordinatorStatus
from protocols.transport.base import Will


@dataclass(frozen=True)
class EngineSettings:
    """How rounds run: deadline, quorum, evaluation cadence and how models travel."""

    fleet: str = "default"
    task: str = ""
    metric: str = ""
    """The task's metric: an evaluation reporting another is dropped ("": not checked)."""
    rounds: int = 10
    round_timeout_s: float = 600.0
    quorum: float = 0.5
    eval_every: int = 0
    seed: int = 0
    guard: GuardSettings = field(default_factory=GuardSettings)
    uplink: Compression = NO_COMPRESSION
    downlink: DownlinkCodec = "none"


@dataclass
class RoundRecord:
    """What one training round did, as written to metrics.jsonl."""

    round_id: int
    participants: int
    selected: int
    train_loss: float
    bytes_up: int
    bytes_down: int
    wall_seconds: float
    scalars: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, float | None] | None = None
    skipped: int = 0
    dropped: int = 0
    """Messages the coordinator dropped while the round ran (malformed, stale, over a limit)."""
    sim_seconds: float | None = None
    """On a simulated clock: the simulated time at which the round's model was published."""

    def as_json(self) -> dict[str, Any]:
        """A flat JSON-ready mapping: a loss devices did not report is null.

        `sim_seconds` is there only on a simulated clock.
        """
        loss = self.train_loss
        document = {**self.__dict__, "train_loss": loss if math.isfinite(loss) else None}
        if self.sim_seconds is None:
            del document["sim_seconds"]
        return document

    def line(self) -> dict[str, Any]:
        """The metrics.jsonl line: `as_json` with `finished_at`, now (epoch seconds).

        Kept out of the record itself, so two runs' records compare equal where they agree.
        """
        return {**self.as_json(), "finished_at": time.time()}


ANNOUNCEMENT_LIFETIME = 2.0
"""Of the deadline: how long a round's retained call for work is kept (MQTT 5 message expiry).
A round's wait lasts at most its deadline plus a grace of a twentieth of it, so by then the round
has closed, and a device that wakes later has nothing to gain from the call or its queued copy."""


def announcement_expiry(round_timeout_s: float) -> int:
    """Seconds after which the broker may drop a synchronous round's announcement."""
    return math.ceil(ANNOUNCEMENT_LIFETIME * round_timeout_s)


def coordinator_will(fleet: str) -> Will:
    """The retained "offline" status the broker publishes if the coordinator vanishes."""
    return Will(
        topics.coordinator_status(fleet),
        encode_frame(CoordinatorStatus(state="offline", fleet=fleet)),
    )
