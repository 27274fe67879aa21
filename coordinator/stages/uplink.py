"""How a round's updates come in: the uplink path the engine collects them through.

The engine plans a round, then hands the path an `UplinkRound`: the plan, the quorum and what
devices must do to their updates. The plain path (`PlainUplink`) announces the round and waits
for each device's own update; the secure path (`coordinator.stages.secure.uplink`) runs secure
aggregation's phases and returns one presummed update. A scheduler may supply its own collection
(`coordinator.scheduling.clock_cohort`). Device messages that only a path understands (secure
aggregation's) go to the engine's path too, so the message intake names no feature either.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.engine.intake import Collector
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import EngineSettings
from coordinator.stages.base import Collected, RoundStage, Skipped
from coordinator.strategies.base import ReceivedUpdate, RoundPlan, Strategy
from protocols.errors import RoundError
from protocols.id_list import listed
from protocols.messages import DevicePrivacy, DeviceUpdate, SecureRound, TensorSpec

logger = logging.getLogger(__name__)


class UplinkHost(Protocol):
    """What an uplink path uses of the engine: explicit, and nothing more."""

    run_id: str
    strategy: Strategy
    settings: EngineSettings
    registry: FleetRegistry
    stage: RoundStage
    uplink: UplinkPath

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The shared tensors' layout."""
        ...

    def announce(
        self,
        round_id: int,
        phase: str,
        plan: RoundPlan | None,
        *,
        privacy: DevicePrivacy | None = None,
        secure: SecureRound | None = None,
    ) -> None:
        """Publish a call for work (`Coordinator.announce`)."""
        ...

    def open_inbox(self, inbox: Collector[ReceivedUpdate] | None) -> None:
        """Collect training updates into `inbox` (None: stop)."""
        ...

    def wait_for_answers(self, collector: Collector[Any]) -> bool:
        """Wait until `collector` settles or the deadline: whether it settled."""
        ...

    def hold(self, device_id: str, reason: str) -> None:
        """Quarantine a device for the rest of the round."""
        ...

    def count_down(self, sent: int) -> None:
        """Bytes sent to devices outside the engine's own publishing."""
        ...


@dataclass(frozen=True)
class UplinkRound:
    """One planned round, as an uplink path collects it."""

    round_id: int
    plan: RoundPlan
    needed: int
    """The quorum: fewer answers fail the round."""
    privacy: DevicePrivacy | None
    population: int
    """Devices online when the round was drawn."""


class Collection(Protocol):
    """Collects a planned round's updates (a scheduler may supply its own)."""

    def collect(self, host: UplinkHost, request: UplinkRound) -> Collected | Skipped:
        """Announce the round and gather what came back.

        Raises:
            RoundError: the round failed (fewer than the quorum answered).
        """
        ...


class UplinkPath(Collection, Protocol):
    """A run's uplink: its collection and the device messages it alone understands.

    `PlainUplink` is the ordinary path.
    """

    shows_losses: bool
    """Whether a device's own train loss reaches the coordinator."""
    presums: bool
    """Whether it collects one sum over the devices, not each device's update."""

    def decline(self, device_id: str, round_id: int | None = None) -> None:
        """A device will not answer (it skipped `round_id`, or is quarantined)."""
        ...

    def takes_updates(self) -> bool:
        """Whether the path collects updates itself now (masked ones), not the engine's inbox."""
        ...

    def on_update(self, update: DeviceUpdate, blob: bytes) -> None:
        """An update the path collects itself (see `takes_updates`)."""
        ...

    def on_message(self, topic: str, payload: bytes) -> None:
        """A message of the path's own protocol.

        Raises:
            RoundError: the path has no protocol of its own.
        """
        ...


def report_stragglers(host: UplinkHost, round_id: int, collector: Collector[Any]) -> None:
    """Record the selected devices still connected when the wait ended that had not answered.

    They let the deadline pass (or, silent since an earlier round, its grace): a wait that
    settled leaves nobody online outstanding.
    """
    deadline = f"the {host.settings.round_timeout_s:.0f} s deadline"
    record_stragglers(host, round_id, collector.outstanding(host.registry.online_ids()), deadline)


def record_stragglers(
    host: UplinkHost, round_id: int, stragglers: Iterable[str], deadline: str
) -> None:
    """Count a round's stragglers in the fleet status and say who they were."""
    late = sorted(stragglers)
    if late:
        host.registry.missed_deadline(round_id, late)
        logger.warning(
            "round %d: %d straggler(s) missed %s: %s", round_id, len(late), deadline, listed(late)
        )


class PlainUplink:
    """Each selected device sends its own update; the round waits for them until its deadline."""

    shows_losses = True
    presums = False

    def collect(self, host: UplinkHost, request: UplinkRound) -> Collected:
        """Announce, then wait for the plain updates: those in by the deadline.

        The wait ends early once no asked device is left to answer (all answered, declined or
        went offline): a round nobody can answer fails at once, not at its deadline.

        Raises:
            RoundError: fewer than the quorum answered.
        """
        round_id, plan = request.round_id, request.plan
        collector: Collector[ReceivedUpdate] = Collector(round_id, "train", set(plan.devices))
        host.open_inbox(collector)
        host.announce(round_id, "train", plan, privacy=request.privacy)
        settled = host.wait_for_answers(collector)
        host.open_inbox(None)
        report_stragglers(host, round_id, collector)
        updates = collector.sorted_answers()
        if len(updates) < request.needed:
            why = "the others declined or went offline" if settled else "by the deadline"
            msg = (
                f"only {len(updates)} of {len(plan.devices)} updates, {why} "
                f"(quorum {request.needed})"
            )
            raise RoundError(msg, round_id=round_id)
        if len(updates) < len(plan.devices):
            missing = sorted(set(plan.devices) - {u.device_id for u in updates})
            logger.warning("round %d closed on quorum without %s", round_id, ", ".join(missing))
        return Collected(
            updates,
            participants=len(updates),
            selected=len(plan.devices),
            within_clip=[u.within_clip for u in updates],
            declined=len(collector.declined),
        )

    def decline(self, device_id: str, round_id: int | None = None) -> None:
        """See `UplinkPath.decline`: the engine's inbox is declined in by the engine."""

    def takes_updates(self) -> bool:
        """See `UplinkPath.takes_updates`: plain updates go to the engine's inbox."""
        return False

    def on_update(self, update: DeviceUpdate, blob: bytes) -> None:
        """See `UplinkPath.on_update`."""
        msg = "an update outside the engine's inbox, but this run collects none"
        raise RoundError(msg, device_id=update.device_id, round_id=update.round_id)

    def on_message(self, topic: str, payload: bytes) -> None:
        """See `UplinkPath.on_message`."""
        msg = "secure aggregation message, but this run does not aggregate securely"
        raise RoundError(msg, topic=topic)
