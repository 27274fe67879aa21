"""Asynchronous buffered aggregation (FedBuff) and synchronous rounds on a simulated clock.

Asynchronous mode (Nguyen et al. 2022, FedBuff): up to `concurrency` devices train at once,
each on the model current when it was asked, and the coordinator aggregates every `buffer`
updates. An update's staleness is how many aggregations happened since its device was asked;
one staler than `max_staleness` is dropped, the others are scaled by the staleness rule
(`coordinator.scheduling.staleness`) before the strategy averages the buffer. A device works at
most once for each model version, so no device fills a buffer alone; a buffer no further device
can add to is aggregated as it is. What the devices asked for an aggregation are told beyond
the plan (differential privacy's clip) is the stages' (`RoundStage.aggregation`), asked before
each aggregation: under DP each aggregation is a release, accounted with no sampling.

Time is real (`pfl-coord serve`: updates count in the order they arrive, a device's work is given
up after the round timeout or when it goes offline) or simulated (`pfl-coord simulate`: a
`SimulatedClock` says when each device finishes or drops out; updates count in simulated order,
whatever order the machine computed them in, so results depend on the seed alone). On the
simulated clock synchronous rounds run here too (`settings=None`): the round's cohort is drawn
from the devices online at its start and it ends when its last device finishes, or at the
deadline, which late updates miss (`coordinator.scheduling.clock_cohort`).

This scheduler decides when and whom; it is the collection step (`Schedule`) of the engine's one
round, whose stages, aggregation, record and publishing are those of every run. Each call of
`run_round` returns one aggregation as a `RoundRecord`, so the run loop, periodic evaluation,
metrics, checkpoints and dashboards are those of synchronous runs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from coordinator.engine.round_types import RoundRecord
from coordinator.engine.rounds import Coordinator
from coordinator.scheduling.async_settings import AsyncSettings
from coordinator.scheduling.availability import SimulatedClock
from coordinator.scheduling.clock_cohort import ClockCohort
from coordinator.scheduling.dispatch import Dispatch, DispatchInbox, Tally
from coordinator.scheduling.fair_share import NO_FAIR_SHARE
from coordinator.scheduling.staleness import weigh_update
from coordinator.stages.base import Collected, Skipped
from coordinator.strategies.base import FleetSnapshot, ReceivedUpdate, RoundPlan
from protocols.errors import RoundError
from protocols.messages import DevicePrivacy

logger = logging.getLogger(__name__)
POLL_S = 0.5
"""How often a real-time coordinator looks for devices that came online or ran out of time."""


class BufferedRounds:
    """Runs a coordinator's aggregations asynchronously, or synchronously on a simulated clock.

    Args:
        settings: FedBuff's settings, or None for synchronous rounds (then `clock` is required).
        clock: the simulated clock, or None for real time.
        participation: the run's fraction of the fleet (the default concurrency).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        settings: AsyncSettings | None,
        clock: SimulatedClock | None,
        participation: float = 1.0,
    ) -> None:
        if settings is None and clock is None:
            msg = "synchronous rounds run here only on a simulated clock"
            raise ValueError(msg)
        self.coordinator = coordinator
        self.settings = settings
        self.clock = clock
        self.participation = participation
        self.inbox = DispatchInbox()
        self.in_flight: dict[str, Dispatch] = {}
        self.buffer: dict[str, tuple[ReceivedUpdate, int]] = {}
        self._asked_for: dict[str, int] = {}
        self.fair_share = NO_FAIR_SHARE if settings is None else settings.fair_share_stage()
        self.told: DevicePrivacy | None = (
            None if settings is None else coordinator.stage.aggregation(settings.buffer)
        )
        """What the devices asked for the aggregation being filled are told (e.g. DP's clip)."""
        coordinator.open_inbox(self.inbox)

    @property
    def timeout_s(self) -> float:
        """How long the coordinator waits for one device's answer or for any progress."""
        return self.coordinator.settings.round_timeout_s

    def close(self) -> None:
        """Stop collecting updates: later ones are stale."""
        self.coordinator.open_inbox(None)

    def run_round(self) -> RoundRecord:
        """One aggregation: the engine's round, with this scheduler's collection.

        Raises:
            RoundError: no device answered within the round timeout (real time), or no device
                will ever be online again (simulated).
        """
        return self.coordinator.run_round(self)

    def collect(self, engine: Coordinator, round_id: int) -> Collected | Skipped:
        """See `Schedule.collect`: fill the buffer, or run a synchronous round on the clock."""
        tally = Tally()
        if self.settings is None:
            return self._synchronous_round(round_id, tally)
        self.told = engine.stage.aggregation(self.settings.buffer)
        self._fill_buffer(round_id, self.settings, tally)
        return self.collected(tally)

    def collected(self, tally: Tally) -> Collected:
        """The buffer, in device-id order, as the engine's round takes it (then emptied)."""
        entries = [self.buffer[d] for d in sorted(self.buffer)]
        self.fair_share.record(self.buffer)
        self.buffer.clear()
        updates = [update for update, _ in entries]
        staleness = [s for _, s in entries]
        return Collected(
            updates,
            participants=len(updates),
            selected=tally.asked,
            within_clip=[u.within_clip for u in updates],
            declined=tally.declined,
            scalars=self.tally_scalars(tally, staleness),
            sim_seconds=None if self.clock is None else self.clock.now,
        )

    def tally_scalars(self, tally: Tally, staleness: list[int]) -> dict[str, float]:
        """The round record's view of `tally` (and, asynchronous, of the buffer's staleness)."""
        out = {"lost": float(tally.lost), "late": float(tally.late)}
        if self.settings is not None:
            out["stale_dropped"] = float(tally.stale)
            out["over_fair_share"] = float(tally.over_share)
            out["in_flight"] = float(len(self.in_flight))
            out["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
            out["staleness_max"] = float(max(staleness, default=0))
        return out

    # -- asynchronous -----------------------------------------------------------------------

    def _fill_buffer(self, round_id: int, settings: AsyncSettings, tally: Tally) -> None:
        """Ask devices and take their updates until the buffer is full or nobody can add to it."""
        progress_by = time.monotonic() + self.timeout_s
        while len(self.buffer) < settings.buffer:
            self._ask(round_id, settings, tally)
            if self.in_flight:
                before = len(self.buffer)
                self._next_events(round_id, settings, tally)
                if len(self.buffer) > before:
                    progress_by = time.monotonic() + self.timeout_s
                continue
            if self.clock is not None:
                if self.buffer:  # nobody online may work on this version any more
                    break
                self._wait_for_simulated_devices(round_id)
                continue
            if time.monotonic() > progress_by:
                if self.buffer:
                    break
                msg = f"no update in {self.timeout_s:g} s: no device is online to train"
                raise RoundError(msg, round_id=round_id)
            c = self.coordinator
            c.transport.wait_until(lambda: self._askable(round_id) != [], POLL_S)
        if self.clock is not None:  # devices still fetching must find the model they were sent
            self.wait_for_answers([d for d, job in self.in_flight.items() if job.survives])

    def _concurrency(self, settings: AsyncSettings) -> int:
        if settings.concurrency:
            return settings.concurrency
        known = self.coordinator.registry.count()
        return max(settings.buffer, math.ceil(self.participation * known))

    def _active(self) -> list[str]:
        """Online devices that may be asked, working or not (a fair share is counted among them)."""
        c = self.coordinator
        held = c.quarantine.held()
        return [
            d
            for d in sorted(c.registry.online_ids())
            if d not in held and (self.clock is None or self.clock.online(d))
        ]

    def _askable(self, round_id: int) -> list[str]:
        """Online devices not working now and not yet asked for this aggregation."""
        return [
            d
            for d in self._active()
            if d not in self.in_flight and self._asked_for.get(d) != round_id
        ]

    def _ask(self, round_id: int, settings: AsyncSettings, tally: Tally) -> None:
        free = self._concurrency(settings) - len(self.in_flight)
        candidates = self._askable(round_id) if free > 0 else []
        candidates = self.fair_share.admit(candidates, len(self._active()), idle=not self.in_flight)
        if not candidates:
            return
        c = self.coordinator
        picked = c.rng.choice(len(candidates), size=min(free, len(candidates)), replace=False)
        chosen = sorted(candidates[i] for i in picked)
        asked = []
        for device_id in chosen:
            dispatch = self.dispatch_job(device_id, round_id)
            self.in_flight[device_id] = dispatch
            self._asked_for[device_id] = round_id
            if dispatch.survives:  # a device that drops out first never gets to answer
                self.inbox.dispatch(device_id, round_id)
                asked.append(device_id)
        tally.asked += len(chosen)
        if asked:
            plan = RoundPlan(tuple(asked))
            c.announce(round_id, "train", plan, privacy=self.told, asynchronous=True)

    def dispatch_job(self, device_id: str, round_id: int) -> Dispatch:
        """Work `device_id` is asked for: when it ends (simulated) or is given up (real time)."""
        if self.clock is None:
            return Dispatch(round_id, deadline=time.monotonic() + self.timeout_s)
        event_s, survives = self.clock.job(device_id, *self._work(device_id))
        return Dispatch(round_id, event_s, survives)

    def _work(self, device_id: str) -> tuple[int, int]:
        """(samples, epochs) of one job of `device_id`, for its simulated duration."""
        c = self.coordinator
        samples = c.registry.declared_samples(device_id) or 0
        return samples, c.strategy.config.work_epochs()

    def _next_events(self, round_id: int, settings: AsyncSettings, tally: Tally) -> None:
        if self.clock is not None:
            device_id = min(self.in_flight, key=lambda d: (self.in_flight[d].event_s, d))
            dispatch = self.in_flight.pop(device_id)
            self.clock.now = max(self.clock.now, dispatch.event_s)
            if dispatch.survives:
                self.wait_for_answers([device_id])
            self._land(device_id, dispatch, settings, tally)
            return
        c = self.coordinator
        soonest = min(d.deadline for d in self.in_flight.values())
        free = self._concurrency(settings) > len(self.in_flight)
        c.transport.wait_until(
            lambda: self.inbox.has_arrivals() or (free and self._askable(round_id) != []),
            max(0.0, min(POLL_S, soonest - time.monotonic())),
        )
        online = c.registry.online_ids()
        now = time.monotonic()
        arrived = self.inbox.arrivals()
        while arrived and len(self.buffer) < settings.buffer:  # K updates an aggregation
            device_id = arrived.pop(0)
            if device_id in self.in_flight:
                self._land(device_id, self.in_flight.pop(device_id), settings, tally)
        self.inbox.requeue(arrived)  # they count towards the next aggregation
        for device_id, dispatch in list(self.in_flight.items()):
            if self.inbox.landed(device_id):
                continue  # its answer is an arrival, settled in order
            if now > dispatch.deadline or device_id not in online:
                logger.info("device %s: work for round %d given up", device_id, dispatch.round_id)
                del self.in_flight[device_id]
                self._land(device_id, dispatch, settings, tally)

    def _land(
        self, device_id: str, dispatch: Dispatch, settings: AsyncSettings, tally: Tally
    ) -> None:
        """A device's work ended: buffer its update (scaled by staleness), or count why not."""
        update, declined = self.inbox.settle(device_id)
        if update is None:
            if declined:  # not asked again for this version: it would decline again
                tally.declined += 1
            else:  # it left or ran out of time: once back it may work on this version
                tally.lost += 1
                self._asked_for.pop(device_id, None)
            return
        staleness = self.coordinator.round_id + 1 - dispatch.round_id
        if staleness > settings.max_staleness:
            tally.stale += 1
            logger.info("device %s: update %d rounds stale, dropped", device_id, staleness)
            return
        fair = self.fair_share.weight(device_id, len(self._active()))
        if fair < 1.0:
            tally.over_share += 1
            logger.info("device %s: over its fair share of buffers, weighed %.2f", device_id, fair)
        weight = settings.staleness.weight(staleness) * fair
        self.buffer[device_id] = (weigh_update(update, weight), staleness)

    def wait_for_answers(self, device_ids: list[str]) -> None:
        """Simulated time: let the machine compute until these devices answered (or left)."""
        c = self.coordinator
        c.transport.wait_until(
            lambda: all(
                self.inbox.landed(d) or d not in c.registry.online_ids() for d in device_ids
            ),
            self.timeout_s,
        )

    def _wait_for_simulated_devices(self, round_id: int) -> None:
        """Nobody can work now: move the simulated clock to when somebody comes online."""
        assert self.clock is not None
        known = sorted(self.coordinator.registry.online_ids())
        at = self.clock.next_online(known)
        if at is None or at <= self.clock.now:
            msg = "no device will be online again to train"
            raise RoundError(msg, round_id=round_id)
        self.clock.now = at

    # -- synchronous, on the simulated clock ------------------------------------------------

    def _synchronous_round(self, round_id: int, tally: Tally) -> Collected | Skipped:
        """One synchronous round: the cohort trains from now; late and lost updates miss it."""
        clock = self.clock
        assert clock is not None
        c = self.coordinator
        while True:
            held = c.quarantine.held()
            fleet = c.registry.snapshot()
            cohort = FleetSnapshot(
                tuple(
                    replace(
                        d, online=d.online and d.device_id not in held and clock.online(d.device_id)
                    )
                    for d in fleet.devices
                )
            )
            if cohort.online():
                break
            self._wait_for_simulated_devices(round_id)
        return c.collect_planned(round_id, cohort, ClockCohort(self, tally))
