"""An evaluation round: every online device scores its personalized and the global model."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from coordinator.engine.device_messages import DeviceIntake
from coordinator.engine.intake import Collector
from coordinator.engine.metrics import summarize_evaluations
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import EngineSettings
from protocols.messages import EvaluationReport
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)


class EvaluationHost(Protocol):
    """What an evaluation round needs of the round engine."""

    registry: FleetRegistry
    round_id: int
    intake: DeviceIntake
    transport: Transport
    settings: EngineSettings

    def pass_over_quarantined(self, collector: Collector[Any]) -> None:
        """Stop `collector` waiting for the devices quarantined now."""
        ...

    def announce(self, round_id: int, phase: str, plan: None, *, final: bool = False) -> None:
        """Publish the call for work."""
        ...


def evaluate_fleet(
    engine: EvaluationHost, *, final: bool
) -> tuple[list[EvaluationReport], dict[str, float | None]]:
    """The reports of the devices online now, and their summary.

    A device quarantined this round is not waited for: everything it sends is ignored until the
    next round starts, its report too.
    """
    registry = engine.registry
    devices = {info.device_id for info in registry.snapshot().devices if info.online}
    collector: Collector[EvaluationReport] = Collector(engine.round_id, "evaluate", devices)
    engine.intake.evaluation = collector
    engine.pass_over_quarantined(collector)
    engine.announce(engine.round_id, "evaluate", None, final=final)
    engine.transport.wait_until(
        lambda: collector.settled(registry.online_ids()), engine.settings.round_timeout_s
    )
    engine.intake.evaluation = None
    reports = collector.sorted_answers()
    if len(reports) < len(devices):
        logger.warning(
            "evaluation of round %d: %d of %d devices answered",
            engine.round_id,
            len(reports),
            len(devices),
        )
    return reports, summarize_evaluations(reports)
