"""Asynchronous mode's settings (what it refuses: `coordinator.stages.features`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.scheduling.fair_share import NO_FAIR_SHARE, FairShare, FairShareStage
from coordinator.scheduling.staleness import StalenessRule


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
