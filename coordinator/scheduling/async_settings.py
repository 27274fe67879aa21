"""Asynchronous mode's settings, and the runs it refuses with the reason."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from coordinator.scheduling.fair_share import NO_FAIR_SHARE, FairShare, FairShareStage
from coordinator.scheduling.staleness import StalenessRule

_GLOBAL_STEP = (
    "its global step mixes one round's personalized models with the previous global model "
    "(beta-weighted), a synchronous step with no asynchronous form"
)
_FLEET_VARIANCE = (
    "its aggregation weights come from the fleet variance estimated over one round's cohort, "
    "which a buffer of updates from different model versions does not estimate"
)
REFUSED: Final[dict[str, str]] = {
    "pfedme": _GLOBAL_STEP,
    "pfedbred": _GLOBAL_STEP,
    "selffl": _FLEET_VARIANCE,
    "selffl-aug": _FLEET_VARIANCE,
    "federico": (
        "devices train on peer models relayed within one round; relays across model versions "
        "have no defined rule"
    ),
    "local": "local training aggregates nothing, so it has no rounds to make asynchronous",
}
"""Algorithms that need a synchronous round, and why."""


@dataclass(frozen=True)
class AsyncSettings:
    """FedBuff's knobs: buffer size K, staleness bound and rule, devices training at once."""

    buffer: int = 10
    max_staleness: int = 10
    staleness: StalenessRule = field(default_factory=StalenessRule)
    concurrency: int = 0
    """Devices training at once (0: the run's participation of the fleet, at least `buffer`)."""
    fair_share: float = 2.0
    """No device's updates weigh more than this x its fair share of recent buffers (0: off)."""
    fair_share_window: int = 20
    """The aggregations `fair_share` counts over."""

    def fair_share_stage(self) -> FairShareStage:
        """The stage weighing down over-represented devices (`scheduling.fair_share`)."""
        if self.fair_share == 0:
            return NO_FAIR_SHARE
        return FairShare(self.fair_share, self.fair_share_window, self.buffer)


def check_async(
    algorithms: Iterable[str],
    *,
    private: bool,
    secure: bool,
    compress_down: str,
    pretrain_rounds: int,
) -> None:
    """Refuse what asynchronous rounds cannot do, naming the reason and the way out.

    Raises:
        ValueError: an algorithm or option that needs synchronous rounds.
    """
    for name in algorithms:
        if name in REFUSED:
            msg = f"--mode async: {name} needs synchronous rounds: {REFUSED[name]}; use --mode sync"
            raise ValueError(msg)
    refused_options = [
        (
            private,
            "differential privacy (--dp-noise)",
            "its accountant counts rounds that each sample one cohort, and buffered updates "
            "from devices asked at different times are not such rounds",
        ),
        (
            secure,
            "secure aggregation (--secagg)",
            "masks cancel only within one round's cohort, and a buffer mixes devices asked at "
            "different times",
        ),
        (
            pretrain_rounds > 0,
            "--pretrain-rounds",
            "the shared part changes between stages, and updates in flight would straddle it",
        ),
        (
            compress_down != "none",
            "--compress-down int8",
            "devices fetch whichever model is current when they start, and a model delta needs "
            "the one just before it; use --compress-down none",
        ),
    ]
    for present, option, reason in refused_options:
        if present:
            msg = f"--mode async does not combine with {option}: {reason}"
            raise ValueError(msg)
