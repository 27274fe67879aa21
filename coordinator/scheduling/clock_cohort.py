"""A synchronous round on the simulated clock: the planned cohort trains from the round's start.

The clock says when each device finishes or drops out (`coordinator.scheduling.availability`).
Updates in by the deadline make the round, late and lost ones miss it, and the round ends when
its last device finishes, or at the deadline. An uplink of device-by-device updates fills the
scheduler's buffer as the devices answer; one that presums them (secure aggregation) is asked for
the sum of the devices the clock lets finish in time: the others drop out before it starts.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

from coordinator.scheduling.availability import SimulatedClock
from coordinator.scheduling.dispatch import Dispatch, DispatchInbox, Tally
from coordinator.stages.base import Collected, Skipped
from coordinator.stages.uplink import UplinkHost, UplinkRound
from coordinator.strategies.base import ReceivedUpdate, RoundPlan


class ClockRounds(Protocol):
    """What a clock round needs of its scheduler (`scheduling.asynchronous.BufferedRounds`)."""

    clock: SimulatedClock | None
    inbox: DispatchInbox
    buffer: dict[str, tuple[ReceivedUpdate, int]]

    def dispatch_job(self, device_id: str, round_id: int) -> Dispatch:
        """When `device_id`, asked now, finishes or drops out."""
        ...

    def collected(self, tally: Tally) -> Collected:
        """The buffer's updates as the round's collection."""
        ...

    def tally_scalars(self, tally: Tally, staleness: list[int]) -> dict[str, float]:
        """The round's counts of lost, late and declined work."""
        ...

    def wait_for_answers(self, device_ids: list[str]) -> None:
        """Let the machine compute until these devices answered (or left)."""
        ...


class ClockCohort:
    """The collection of one synchronous round of `rounds` on its simulated clock."""

    def __init__(self, rounds: ClockRounds, tally: Tally) -> None:
        self.rounds = rounds
        self.tally = tally

    def collect(self, host: UplinkHost, request: UplinkRound) -> Collected | Skipped:
        """See `Collection.collect`: what came in by the deadline; the clock moves to the end."""
        clock, plan = self.rounds.clock, request.plan
        assert clock is not None
        jobs = {d: self.rounds.dispatch_job(d, request.round_id) for d in plan.devices}
        deadline = clock.now + clock.deadline_s if clock.deadline_s else math.inf
        self.tally.asked = len(plan.devices)
        if host.uplink.presums:
            outcome = self._presummed(host, request, jobs, deadline)
        else:
            self._each(host, request, jobs, deadline)
        ends = [job.event_s for job in jobs.values()]
        clock.now = min(max(ends, default=clock.now), deadline)
        if not host.uplink.presums:
            return self.rounds.collected(self.tally)
        scalars = {**outcome.scalars, **self.rounds.tally_scalars(self.tally, [])}
        return replace(outcome, selected=len(plan.devices), scalars=scalars, sim_seconds=clock.now)

    def _each(
        self, host: UplinkHost, request: UplinkRound, jobs: dict[str, Dispatch], deadline: float
    ) -> None:
        """Device-by-device updates: the survivors are asked, those in time are buffered."""
        rounds, plan, round_id = self.rounds, request.plan, request.round_id
        asked = tuple(d for d in plan.devices if jobs[d].survives)
        for device_id in asked:
            rounds.inbox.dispatch(device_id, round_id)
        if asked:
            scalars = {d: plan.scalars[d] for d in asked if d in plan.scalars}
            host.announce(round_id, "train", RoundPlan(asked, scalars), privacy=request.privacy)
            rounds.wait_for_answers(list(asked))
        for device_id in plan.devices:
            update, declined = rounds.inbox.settle(device_id)
            if update is None and not declined:
                self.tally.lost += 1
            elif update is None:
                self.tally.declined += 1
            elif jobs[device_id].event_s > deadline:
                self.tally.late += 1
            else:
                rounds.buffer[device_id] = (update, 0)

    def _presummed(
        self, host: UplinkHost, request: UplinkRound, jobs: dict[str, Dispatch], deadline: float
    ) -> Collected | Skipped:
        """One sum: over the devices that stay online and finish by the deadline."""
        plan = request.plan
        in_time = tuple(d for d in plan.devices if jobs[d].survives and jobs[d].event_s <= deadline)
        self.tally.lost = sum(not jobs[d].survives for d in plan.devices)
        self.tally.late = len(plan.devices) - len(in_time) - self.tally.lost
        kept = RoundPlan(in_time, {d: plan.scalars[d] for d in in_time if d in plan.scalars})
        return host.uplink.collect(host, replace(request, plan=kept))
