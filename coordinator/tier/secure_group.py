"""Secure aggregation within one aggregator's group: the flat protocol, over its members only.

A secure round's announcement (the coordinator's, retained) asks the whole cohort. Each
aggregator runs the protocol's phases (`SecureAggregator`: keys, roster, shares, masked updates,
unmasking, every check) with the cohort's members in its group, so a device's masking cost grows
with its group, not with the fleet, and the aggregator learns its group's sum, never one update.
The roster and the unmasking go to each member's own topic (`per_device`): the devices of other
groups on a shared broker never see them.

The phases wait for the devices, so a round runs on a thread of its own; its keys phase opens
before `start` returns, so no device's keys arrive before they are expected. A group round that
fails (fewer than the announced minimum answer a phase, a dealer lies, a sum no honest devices
send) is not retried: the announcement is the coordinator's, and the devices dealt their keys
for it. The group sends an empty partial and the round goes on at quorum without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from coordinator.stages.secure.aggregator import SecureAggregator
from coordinator.stages.secure.unmask import SecureSum
from protocols import secure_aggregation as sa
from protocols.errors import RoundError
from protocols.messages import DeviceUpdate, RoundAnnouncement, TensorSpec
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)
OPEN_WAIT_S = 30.0
"""How long `start` waits for the round's thread to open the keys phase (it takes moments)."""

Done = Callable[[SecureSum | None, str], None]
"""Called once from the round's thread: the group's sum (None: none), and why not."""


@dataclass(frozen=True)
class GroupCohort:
    """What one group's secure round runs on."""

    announcement: RoundAnnouncement
    members: tuple[str, ...]
    """The cohort's devices in this group, sorted."""
    specs: tuple[TensorSpec, ...]
    train_timeout_s: float
    online: Callable[[], AbstractSet[str]]


class GroupSecureRound:
    """A group's secure rounds, one at a time, each on its own thread; device messages go to it.

    One protocol instance serves every round, so the answers that arrive after a round ended
    (reveals beyond the threshold) are known as late, not taken for offences.
    """

    def __init__(self, transport: Transport, fleet: str, blame: Callable[[str, str], None]) -> None:
        # The round's parameters come from its announcement: these settings are not read.
        self.protocol = SecureAggregator(
            sa.SecureAggregationSettings(), transport, fleet, blame, per_device=True
        )
        self.thread: threading.Thread | None = None

    def start(self, cohort: GroupCohort, done: Done) -> None:
        """Run the round's phases for `cohort` and call `done` with its outcome."""
        announcement, secure = cohort.announcement, cohort.announcement.secure
        assert secure is not None
        if self.thread is not None and self.thread.is_alive():
            done(None, "the group's previous secure round is still running: it sits this one out")
            return
        if len(cohort.members) < secure.min_survivors:
            reason = (
                f"{len(cohort.members)} of the cohort in this group, under the round's minimum "
                f"{secure.min_survivors}: the group sits the round out"
            )
            done(None, reason)
            return
        opened = threading.Event()

        def run() -> None:
            self.protocol.late.clear()  # the group's stragglers are not reported upstream yet
            try:
                total = self.protocol.run(
                    announcement.run_id,
                    announcement.round_id,
                    secure,
                    cohort.members,
                    cohort.specs,
                    cohort.online,
                    cohort.train_timeout_s,
                    opened.set,
                )
            except RoundError as error:
                opened.set()
                done(None, str(error))
                return
            done(total, "")

        self.thread = threading.Thread(
            target=run, name=f"secure-round-{announcement.round_id}", daemon=True
        )
        self.thread.start()
        if not opened.wait(OPEN_WAIT_S):
            logger.warning("round %d's keys phase did not open", announcement.round_id)

    def decline(self, device_id: str, round_id: int) -> None:
        """A member skipped the round, went offline or was quarantined: no phase waits for it."""
        self.protocol.decline(device_id, round_id)

    def on_message(self, topic: str, payload: bytes) -> None:
        """A member's keys, shares or reveal (see `SecureAggregator.on_message`)."""
        self.protocol.on_message(topic, payload)

    def on_update(self, update: DeviceUpdate, blob: bytes) -> None:
        """A member's masked update (see `SecureAggregator.on_update`)."""
        self.protocol.on_update(update, blob)
