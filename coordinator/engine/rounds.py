"""The round engine: select, broadcast, collect until all answered or the deadline, aggregate.

It does not know which transport carries its messages. It owns deadlines, quorum, duplicate and
stale-message dropping, byte accounting and the per-round record; the strategy owns the math.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from coordinator.engine.device_messages import DeviceMessages
from coordinator.engine.downlink import ModelPublisher
from coordinator.engine.flapping import FlapWatch
from coordinator.engine.fleet_view import fleet_status
from coordinator.engine.intake import (
    Collector,
)
from coordinator.engine.metrics import summarize_evaluations
from coordinator.engine.quarantine import Quarantine
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import EngineSettings, RoundRecord, coordinator_will
from coordinator.engine.silence import SilentDevices
from coordinator.ops.once import OnceEach, kind_of
from coordinator.stages.aggregate_guard import guarded_aggregate
from coordinator.stages.privacy import PrivacyEngine
from coordinator.stages.relay import RelayHook, relay_for
from coordinator.stages.secure_aggregation import SecureAggregator, SecureSum, weight_bound
from coordinator.stages.secure_retry import (
    SecureRequest,
    SkippedRound,
    account_skipped,
    secure_round,
)
from coordinator.strategies.base import ModelBuilder, ReceivedUpdate, RoundPlan, Strategy
from protocols import topics
from protocols.codec import Tensors, describe_tensors, encode_frame
from protocols.errors import RoundError
from protocols.messages import (
    Command,
    CoordinatorStatus,
    DeviceAssignment,
    DevicePrivacy,
    EvaluationReport,
    FleetStatus,
    RoundAnnouncement,
    SecureRound,
)
from protocols.offences import Offences
from protocols.transport.base import Transport

logger = logging.getLogger(__name__)
__all__ = ["Coordinator", "EngineSettings", "RoundRecord", "coordinator_will"]


class Coordinator(DeviceMessages):
    """Drives rounds over any transport.

    It holds the whole model: the shared tensors it aggregates, and the initial values of the
    personal ones (the task's initialization, or the pretrained model's part), which it broadcasts
    with the shared ones so a new or stateless device can start its personal part from them.
    That initialization is global, not personal: sending it leaks nothing (spec
    partial-personalization.md §3.3).
    """

    def __init__(
        self,
        transport: Transport,
        strategy: Strategy,
        model: Tensors,
        settings: EngineSettings,
        shared_names: Sequence[str] | None = None,
        build_model: ModelBuilder | None = None,
    ) -> None:
        self.transport = transport
        self.strategy = strategy
        self.model = dict(model)
        self.shared_names = tuple(model) if shared_names is None else tuple(shared_names)
        self.settings = settings
        self.registry = FleetRegistry()
        self.rng = np.random.default_rng(settings.seed)
        self.round_id = 0
        self.run_id = uuid.uuid4().hex  # a resumed run takes its checkpoint's
        self.bytes_up = 0
        self.bytes_down = 0
        self.rejected = 0
        self.offences = Offences()
        self.quarantine = Quarantine(settings.guard.quarantine_after)
        self.silent = SilentDevices()
        self.flaps = FlapWatch()
        self.guard_notes = OnceEach(logger, "said once per device; later rounds count in guard_cut")
        self.last_fleet_status: FleetStatus | None = None
        self.last_scalars: dict[str, float] = {}
        self.models = ModelPublisher(transport, settings.fleet, settings.downlink)
        self._state = "online"
        self._announcement: bytes | None = None
        self._specs = describe_tensors(self.shared)
        self._train: Collector[ReceivedUpdate] | None = None
        self._evaluation: Collector[EvaluationReport] | None = None
        self._build_model = build_model
        self.relay: RelayHook = relay_for(strategy, self.model, build_model, settings.seed)
        self.privacy: PrivacyEngine | None = None  # differential privacy, when the run asks
        self.secure: SecureAggregator | None = None  # secure aggregation, when the run asks

    @property
    def shared(self) -> Tensors:
        """The tensors devices train together and the coordinator aggregates."""
        return {name: self.model[name] for name in self.shared_names}

    @shared.setter
    def shared(self, tensors: Tensors) -> None:
        self.model.update(tensors)

    def switch_strategy(self, strategy: Strategy, shared_names: Sequence[str]) -> None:
        """Move to the next stage of a pipeline (e.g. FedAvg pretraining, then FedAlt).

        The tensors that become personal keep their current values as every device's personal
        starting point: the warm start of spec partial-personalization.md §3.1(b).
        """
        self.strategy = strategy
        self.shared_names = tuple(shared_names)
        self._specs = describe_tensors(self.shared)
        self.relay = relay_for(strategy, self.model, self._build_model, self.settings.seed)

    # -- wiring -----------------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to device topics, publish status and the initial model, ask for hellos."""
        fleet = self.settings.fleet
        handlers: dict[topics.DeviceTopicKind, Callable[[str, bytes], None]] = {
            "hello": self._on_hello,
            "status": self._on_status,
            "update": self._on_update,
            "request": self._on_request,
            "evaluation": self._on_evaluation,
            "secagg": self._on_secagg,
        }
        for kind, handler in handlers.items():
            self.transport.subscribe(
                topics.device_subscription(fleet, kind), self._guarded(handler)
            )
        self.publish_status("online")
        self.publish_model()
        self._broadcast(topics.command(fleet), encode_frame(Command(action="hello")))

    def wait_for_devices(self, count: int, timeout_s: float) -> bool:
        """Let hellos arrive until `count` devices are online or `timeout_s` passes."""
        return self.transport.wait_until(lambda: self.registry.online_count() >= count, timeout_s)

    def republish(self) -> None:
        """After a reconnect: a restarted broker lost the retained status, model and round."""
        self.publish_status(self._state)
        self.publish_model()
        if self._announcement is not None:
            self._broadcast(
                topics.round_announcement(self.settings.fleet), self._announcement, retain=True
            )
        self._broadcast(topics.command(self.settings.fleet), encode_frame(Command(action="hello")))

    def publish_status(self, state: str) -> None:
        """Retained coordinator liveness and progress."""
        self._state = state
        status = CoordinatorStatus(
            state=state,  # type: ignore[arg-type]
            fleet=self.settings.fleet,
            task=self.settings.task,
            algorithm=self.strategy.name,
            round_id=self.round_id,
            rounds=self.settings.rounds,
        )
        self.transport.publish(
            topics.coordinator_status(self.settings.fleet), encode_frame(status), retain=True
        )

    def publish_model(self, *, force: bool = True) -> None:
        """Retain the current model for the devices asked to work on it (`engine.downlink`).

        With force=False an unchanged model is not sent again.
        """
        self.models.publish(self.model, self.round_id, force=force)

    def publish_fleet_status(self) -> None:
        """Retain the registry's view, so `pfl-coord status` shows each device's round and loss."""
        status = fleet_status(
            self.settings.fleet,
            self.round_id,
            self.registry,
            self.offences,
            held=self.quarantine.held(),
            flapping=self.flaps.flapping(),
            scalars=self.last_scalars,
        )
        self.transport.publish(
            topics.fleet_status(self.settings.fleet), encode_frame(status), retain=True
        )
        self.last_fleet_status = status  # also written to a run directory, for dashboards

    # -- rounds -----------------------------------------------------------------------------

    def run_round(self) -> RoundRecord:
        """One training round: plan, announce, collect, aggregate, publish the new model.

        Raises:
            RoundError: no device is online, or fewer than the quorum answered by the deadline.
        """
        started = time.perf_counter()
        up_before, down_before = self.bytes_up, self.bytes_down
        round_id = self.round_id + 1
        self.quarantine.start_round(round_id, self.offences.counts())
        fleet = self.registry.snapshot()
        cohort = fleet if self.privacy is None else self.privacy.cohort(fleet, self.rng)
        plan = self.strategy.plan_round(round_id, cohort, self.rng)
        nobody = not plan.devices
        if nobody and (self.privacy is None or not self.privacy.releases_empty(fleet)):
            msg = "no device is online to train"
            raise RoundError(msg, round_id=round_id)
        self.relay.start_round(round_id)
        needed = max(1, math.ceil(self.settings.quorum * len(plan.devices)))
        dp = None if self.privacy is None else self.privacy.plan(fleet, plan.devices)
        secure_sum: SecureSum | None = None
        updates: list[ReceivedUpdate] = []
        declined = 0
        if nobody:  # nothing to collect
            logger.info("round %d: the Poisson draw is empty: only noise is released", round_id)
        elif self.secure is None:
            updates, declined = self._collect_updates(round_id, plan, needed, dp)
        else:
            outcome = self._collect_secure_sum(round_id, plan, needed, dp)
            if isinstance(outcome, SkippedRound):
                traffic = (up_before, down_before, started)
                return self._skip(round_id, plan, outcome, len(fleet.online()), traffic)
            secure_sum = outcome
            updates, declined = [secure_sum.as_update(mean=self.privacy is None)], 0
        within_clip = (
            [u.within_clip for u in updates] if secure_sum is None else [secure_sum.within]
        )
        participants = len(updates) if secure_sum is None else len(secure_sum.survivors)
        if self.privacy is not None:
            updates = self.privacy.privatize(updates, self.shared, presummed=secure_sum is not None)
        scalars, norm_median = self.apply_updates(round_id, updates)
        if secure_sum is not None:
            scalars.update(secure_sum.scalars())
        elif self.privacy is None:
            scalars["update_norm_median"] = norm_median
        if self.privacy is not None:  # released, even if skipped (the noise was drawn)
            scalars.update(self.privacy.finish(within_clip, reporters=participants))
        self.finish_round(round_id, scalars)
        samples = sum(u.num_samples for u in updates)
        loss = sum(u.train_loss * u.num_samples for u in updates) / samples if samples else 0.0
        if self.privacy is not None:
            loss = math.nan  # devices do not report it under DP
        return RoundRecord(
            round_id=round_id,
            participants=participants,
            selected=len(plan.devices),
            train_loss=loss,
            bytes_up=self.bytes_up - up_before,
            bytes_down=self.bytes_down - down_before,
            wall_seconds=time.perf_counter() - started,
            scalars=scalars,
            skipped=declined,
        )

    def _skip(
        self,
        round_id: int,
        plan: RoundPlan,
        skipped: SkippedRound,
        population: int,
        since: tuple[int, int, float],
    ) -> RoundRecord:
        """A secure round that gave no sum: the model unchanged, any release accounted.

        `since`: bytes up, bytes down and the clock when the round started.
        """
        up_before, down_before, started = since
        scalars = skipped.scalars()
        if self.privacy is not None:
            scalars.update(account_skipped(self.privacy, skipped, population, len(plan.devices)))
        self.finish_round(round_id, scalars)
        return RoundRecord(
            round_id=round_id,
            participants=0,
            selected=len(plan.devices),
            train_loss=math.nan,
            bytes_up=self.bytes_up - up_before,
            bytes_down=self.bytes_down - down_before,
            wall_seconds=time.perf_counter() - started,
            scalars=scalars,
        )

    def apply_updates(
        self, round_id: int, updates: Sequence[ReceivedUpdate]
    ) -> tuple[dict[str, float], float]:
        """Aggregate `updates` (device-id order) through the guard into the shared model.

        Returns the round's scalars and the median update norm. A rejected aggregate leaves
        the model unchanged and says so in the scalars.
        """
        guarded = guarded_aggregate(
            self.strategy,
            round_id,
            self.shared,
            updates,
            self.settings.guard,
            restorable=self.relay.resends_model,
        )
        for device_id, reason in guarded.cut.items():
            self.guard_notes.warning(
                (device_id, kind_of(reason)), f"round {round_id}: {device_id}: {reason}"
            )
        scalars = dict(guarded.aggregate.scalars) if guarded.aggregate is not None else {}
        if guarded.aggregate is not None:
            self.shared = guarded.aggregate.shared
        else:
            logger.error("round %d skipped, the model is unchanged: %s", round_id, guarded.rejected)
            scalars["aggregate_rejected"] = 1.0
        if guarded.cut:
            scalars["guard_cut"] = float(len(guarded.cut))
        return scalars, guarded.norm_median

    def finish_round(self, round_id: int, scalars: dict[str, float]) -> None:
        """Round `round_id` is aggregated: publish its model and the fleet's status."""
        self.last_scalars = scalars
        self.round_id = round_id
        self.publish_model(force=self.relay.resends_model)
        self.publish_fleet_status()

    def open_inbox(self, inbox: Collector[ReceivedUpdate] | None) -> None:
        """Collect training updates into `inbox` until closed with None (asynchronous rounds)."""
        self._train = inbox

    def _collect_updates(
        self, round_id: int, plan: RoundPlan, needed: int, dp: DevicePrivacy | None
    ) -> tuple[list[ReceivedUpdate], int]:
        """Announce, then wait for the plain updates: (those in by the deadline, declines).

        The wait ends early once no asked device is left to answer (all answered, declined or
        went offline): a round nobody can answer fails at once, not at its deadline.

        Raises:
            RoundError: fewer than `needed` answered.
        """
        collector: Collector[ReceivedUpdate] = Collector(round_id, "train", set(plan.devices))
        self._train = collector
        self._pass_over_quarantined(collector)
        self.announce(round_id, "train", plan, privacy=dp)
        online = self.registry.online_ids
        settled = self.silent.wait(self.transport, collector, online, self.settings.round_timeout_s)
        self._train = None
        updates = collector.sorted_answers()
        if len(updates) < needed:
            why = "the others declined or went offline" if settled else "by the deadline"
            msg = f"only {len(updates)} of {len(plan.devices)} updates, {why} (quorum {needed})"
            raise RoundError(msg, round_id=round_id)
        if len(updates) < len(plan.devices):
            missing = sorted(set(plan.devices) - {u.device_id for u in updates})
            logger.warning("round %d closed on quorum without %s", round_id, ", ".join(missing))
        return updates, len(collector.declined)

    def _collect_secure_sum(
        self, round_id: int, plan: RoundPlan, needed: int, dp: DevicePrivacy | None
    ) -> SecureSum | SkippedRound:
        """Announce a secure round and run its phases (coordinator.stages.secure_aggregation).

        A round that fails is retried or skipped there (coordinator.stages.secure_retry).
        """
        secure = self.secure
        assert secure is not None
        declared = [self.registry.declared_samples(d) for d in plan.devices]
        private = self.privacy is not None
        weights = weight_bound(self.strategy, declared, private, secure.settings.max_weight_share)

        def announce(cohort: tuple[str, ...], secure_round: SecureRound) -> None:
            kept = RoundPlan(cohort, {d: plan.scalars[d] for d in cohort if d in plan.scalars})
            self.announce(round_id, "train", kept, privacy=dp, secure=secure_round)

        def plan_secure(cohort: tuple[str, ...]) -> SecureRound:
            secure_round = secure.plan(cohort, dp, weights, min(needed, len(cohort)))
            if self.privacy is not None:  # the grid a discrete Gaussian is counted on
                self.privacy.ring(secure_round, sum(math.prod(s.shape) for s in self._specs))
            return secure_round

        request = SecureRequest(
            self.run_id,
            round_id,
            tuple(plan.devices),
            self._specs,
            self.settings.round_timeout_s,
            self.registry.online_ids,
            plan_secure,
            announce,
            self.quarantine.hold,
        )
        sent_before = secure.bytes_down
        try:
            return secure_round(secure, request)
        finally:
            self.bytes_down += secure.bytes_down - sent_before

    def evaluate(
        self, *, final: bool = False
    ) -> tuple[list[EvaluationReport], dict[str, float | None]]:
        """Ask every online device to evaluate its personalized and the global model.

        A device quarantined this round is not waited for: everything it sends is ignored
        until the next round starts, its report too.
        """
        devices = {info.device_id for info in self.registry.snapshot().devices if info.online}
        collector: Collector[EvaluationReport] = Collector(self.round_id, "evaluate", devices)
        self._evaluation = collector
        self._pass_over_quarantined(collector)
        self.announce(self.round_id, "evaluate", None, final=final)
        self.transport.wait_until(
            lambda: collector.settled(self.registry.online_ids()), self.settings.round_timeout_s
        )
        self._evaluation = None
        reports = collector.sorted_answers()
        if len(reports) < len(devices):
            logger.warning(
                "evaluation of round %d: %d of %d devices answered",
                self.round_id,
                len(reports),
                len(devices),
            )
        return reports, summarize_evaluations(reports)

    def _pass_over_quarantined(self, collector: Collector[Any]) -> None:
        """Stop `collector` waiting for the devices quarantined now.

        Called once the engine holds `collector`: the message intake declines in it any device
        quarantined from then on, so none falls between the two.
        """
        for device_id in self.quarantine.held():
            collector.decline(device_id)

    def announce(
        self,
        round_id: int,
        phase: str,
        plan: RoundPlan | None,
        *,
        final: bool = False,
        privacy: DevicePrivacy | None = None,
        secure: SecureRound | None = None,
        asynchronous: bool = False,
    ) -> None:
        """Publish (retained) a call for work: `plan`'s devices, or every device without one."""
        selected = () if plan is None else tuple(sorted(plan.devices))
        assignments = {  # scalars only for the devices that have any: every device reads this
            d: DeviceAssignment(scalars=dict(plan.scalars[d]))
            for d in selected
            if plan is not None and plan.scalars.get(d)
        }
        announcement = RoundAnnouncement(
            run_id=self.run_id,
            round_id=round_id,
            phase=phase,  # type: ignore[arg-type]
            algorithm=self.strategy.name,
            config=self.strategy.config.model_dump(mode="json"),
            model_sha256=self.models.sha,
            deadline_s=self.settings.round_timeout_s,
            selected=selected,
            assignments=assignments,
            final=final,
            peers=self.relay.peers(self.registry.snapshot()),
            uplink=self.settings.uplink,
            delta_base_sha256=self.models.delta_base,
            privacy=privacy,
            secure=secure,
            asynchronous=asynchronous,
        )
        self._announcement = encode_frame(announcement)
        self._broadcast(
            topics.round_announcement(self.settings.fleet), self._announcement, retain=True
        )
        asked = selected or self.registry.online_ids()
        self.bytes_down += self.models.download_bytes(asked)

    def _broadcast(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        self.transport.publish(topic, payload, retain=retain)
        self.bytes_down += len(payload) * self.registry.online_count()
