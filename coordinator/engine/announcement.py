"""The round announcement: what every device reads to learn whether and how to work."""

from __future__ import annotations

from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import EngineSettings
from coordinator.stages.relay import RelayHook
from coordinator.strategies.base import RoundPlan, Strategy
from protocols.messages import DeviceAssignment, DevicePrivacy, RoundAnnouncement, SecureRound


def round_announcement(
    *,
    run_id: str,
    round_id: int,
    phase: str,
    plan: RoundPlan | None,
    strategy: Strategy,
    settings: EngineSettings,
    relay: RelayHook,
    registry: FleetRegistry,
    model_sha256: str,
    delta_base_sha256: str | None,
    final: bool,
    privacy: DevicePrivacy | None,
    secure: SecureRound | None,
    asynchronous: bool,
) -> RoundAnnouncement:
    """A call for work to `plan`'s devices (every device without a plan).

    Scalars go only to the devices that have any: every device reads this message.
    """
    selected = () if plan is None else tuple(sorted(plan.devices))
    assignments = {
        d: DeviceAssignment(scalars=dict(plan.scalars[d]))
        for d in selected
        if plan is not None and plan.scalars.get(d)
    }
    return RoundAnnouncement(
        run_id=run_id,
        round_id=round_id,
        phase=phase,  # type: ignore[arg-type]
        algorithm=strategy.name,
        config=strategy.config.model_dump(mode="json"),
        model_sha256=model_sha256,
        deadline_s=settings.round_timeout_s,
        selected=selected,
        assignments=assignments,
        final=final,
        peers=relay.peers(registry.snapshot()),
        uplink=settings.uplink,
        delta_base_sha256=delta_base_sha256,
        privacy=privacy,
        secure=secure,
        asynchronous=asynchronous,
    )
