"""The round engine: select, broadcast, collect until all answered or the deadline, aggregate.

It does not know which transport carries its messages. It owns deadlines, quorum, duplicate and
stale-message dropping, byte accounting and the per-round record; the strategy owns the math.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from coordinator.engine.announcement import round_announcement
from coordinator.engine.device_messages import DeviceIntake, IntakeParts, Traffic
from coordinator.engine.downlink import ModelPublisher
from coordinator.engine.evaluation_round import evaluate_fleet
from coordinator.engine.flapping import FlapWatch
from coordinator.engine.fleet_view import FleetPages, fleet_status
from coordinator.engine.intake import Collector
from coordinator.engine.once import OnceEach
from coordinator.engine.quarantine import Quarantine
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import (
    EngineSettings,
    RoundRecord,
    announcement_expiry,
    coordinator_will,
)
from coordinator.engine.run_state import RunState
from coordinator.engine.silence import SilentDevices
from coordinator.stages.aggregate_guard import guarded_aggregate
from coordinator.stages.base import Collected, RoundStage, Skipped, StageChain
from coordinator.stages.relay import RelayHook, relay_for
from coordinator.stages.uplink import Collection, PlainUplink, UplinkPath, UplinkRound
from coordinator.strategies.base import (
    FleetSnapshot,
    ModelBuilder,
    ReceivedUpdate,
    RoundPlan,
    Strategy,
)
from protocols import topics
from protocols.codec import Tensors, describe_tensors, encode_frame
from protocols.errors import RoundError
from protocols.messages import (
    Command,
    CoordinatorStatus,
    DevicePrivacy,
    EvaluationReport,
    FleetStatus,
    FleetSummary,
    SecureRound,
    TensorSpec,
)
from protocols.offences import Offences
from protocols.transport.base import Transport, publish_expiring

logger = logging.getLogger(__name__)
__all__ = ["Coordinator", "EngineSettings", "RoundRecord", "Schedule", "coordinator_will"]


class Schedule(Protocol):
    """When and whom a round asks (`coordinator.scheduling`): the collection step of a round."""

    def collect(self, engine: Coordinator, round_id: int) -> Collected | Skipped:
        """Collect round `round_id`'s updates (e.g. `engine.collect_planned` on a cohort).

        Raises:
            RoundError: the round cannot be collected.
        """
        ...


class Coordinator:
    """Drives rounds over any transport.

    It holds the whole model: the shared tensors it aggregates, and the initial values of the
    personal ones (the task's initialization, or the pretrained model's part), which it broadcasts
    with the shared ones so a new or stateless device can start its personal part from them.
    That initialization is global, not personal: sending it leaks nothing (spec
    partial-personalization.md §3.3).

    The run's round stages (e.g. differential privacy's), uplink path (plain, or secure
    aggregation's) and fleet registry are given here; the engine's round names no feature.
    """

    def __init__(
        self,
        transport: Transport,
        strategy: Strategy,
        model: Tensors,
        settings: EngineSettings,
        shared_names: Sequence[str] | None = None,
        build_model: ModelBuilder | None = None,
        *,
        stages: Sequence[RoundStage] = (),
        uplink: UplinkPath | None = None,
        offences: Offences | None = None,
        registry: FleetRegistry | None = None,
    ) -> None:
        self.transport = transport
        self.strategy = strategy
        self.model = dict(model)
        self.shared_names = tuple(model) if shared_names is None else tuple(shared_names)
        self.settings = settings
        self.registry = FleetRegistry() if registry is None else registry
        self.rng = np.random.default_rng(settings.seed)
        self.round_id = 0
        self.run_id = uuid.uuid4().hex  # a resumed run takes its checkpoint's
        self.traffic = Traffic()
        self.offences = Offences() if offences is None else offences
        self.quarantine = Quarantine(settings.guard.quarantine_after)
        self.silent = SilentDevices()
        self.flaps = FlapWatch()
        self.guard_notes = OnceEach(logger, "said once per device; later rounds count in guard_cut")
        self.fleet_pages = FleetPages(settings.fleet, transport, self.registry)
        self.last_fleet_summary: FleetSummary | None = None
        self.last_scalars: dict[str, float] = {}
        self.models = ModelPublisher(transport, settings.fleet, settings.downlink)
        self.run_state = RunState(self._send_status)
        self._announcement: bytes | None = None
        self._announcement_expiry: int | None = None
        self._specs = describe_tensors(self.shared)
        self._build_model = build_model
        self.relay: RelayHook = relay_for(strategy, self.model, build_model, settings.seed)
        self.stages = tuple(stages)
        self.stage: RoundStage = StageChain(self.stages)
        self.uplink: UplinkPath = PlainUplink() if uplink is None else uplink
        parts = IntakeParts(
            transport,
            self.registry,
            self.models,
            self.offences,
            self.quarantine,
            self.flaps,
            self.silent,
            self.traffic,
        )
        self.intake = DeviceIntake(self, parts)

    @property
    def bytes_up(self) -> int:
        """Payload bytes devices sent the engine."""
        return self.traffic.bytes_up

    @property
    def bytes_down(self) -> int:
        """Payload bytes the engine sent devices."""
        return self.traffic.bytes_down

    @property
    def rejected(self) -> int:
        """Device messages dropped (malformed, stale, over a limit)."""
        return self.traffic.rejected

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
        for kind, handler in self.intake.handlers().items():
            self.transport.subscribe(topics.device_subscription(fleet, kind), handler)
        self.publish_status("online")
        self.publish_model()
        self._broadcast(topics.command(fleet), encode_frame(Command(action="hello")))

    def wait_for_devices(self, count: int, timeout_s: float) -> bool:
        """Let hellos arrive until `count` devices are online or `timeout_s` passes."""
        return self.transport.wait_until(lambda: self.registry.online_count() >= count, timeout_s)

    def republish(self) -> None:
        """After a reconnect: a restarted broker lost the retained status, model and round."""
        fleet = self.settings.fleet
        self.run_state.republish()
        self.publish_model()
        if self._announcement is not None:
            self._broadcast(
                topics.round_announcement(fleet),
                self._announcement,
                retain=True,
                expiry_s=self._announcement_expiry,
            )
        self._broadcast(topics.command(fleet), encode_frame(Command(action="hello")))

    def publish_status(self, state: str) -> None:
        """Retained coordinator liveness and progress (waits and stops: `run_state`)."""
        self.run_state.set(state)

    def _send_status(self, **fields: Any) -> None:
        status = CoordinatorStatus(
            fleet=self.settings.fleet,
            task=self.settings.task,
            algorithm=self.strategy.name,
            round_id=self.round_id,
            rounds=self.settings.rounds,
            **fields,
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
        """Retain the rows that changed and a summary: `pfl-coord status` shows each device."""
        self.last_fleet_summary = self.fleet_pages.publish(
            self.round_id,
            self.offences,
            held=self.quarantine.held(),
            flapping=self.flaps.flapping(),
            scalars=self.last_scalars,
        )

    @property
    def last_fleet_status(self) -> FleetStatus | None:
        """The whole fleet status now, once one was published (for a run directory): O(fleet)."""
        if self.last_fleet_summary is None:
            return None
        held, flapping = self.quarantine.held(), self.flaps.flapping()
        return fleet_status(
            self.settings.fleet,
            self.round_id,
            self.registry,
            self.offences,
            held=held,
            flapping=flapping,
            scalars=self.last_scalars,
        )

    # -- rounds -----------------------------------------------------------------------------

    def run_round(self, schedule: Schedule | None = None) -> RoundRecord:
        """One training round: collect (as `schedule` says), run the stages, aggregate, publish.

        The default schedule is synchronous: cohort -> plan -> announce -> the uplink's collection
        (`collect_planned`). A scheduler (`coordinator.scheduling`) supplies its own collection;
        the stages, the aggregation and the round's record are this one code path.

        Raises:
            RoundError: no device is online, or fewer than the quorum answered by the deadline.
        """
        started = time.perf_counter()
        up_before, down_before = self.bytes_up, self.bytes_down
        round_id = self.round_id + 1
        self.quarantine.start_round(round_id, self.offences.counts())
        if schedule is None:
            collected = self.collect_planned(round_id, self.registry.snapshot())
        else:
            collected = schedule.collect(self, round_id)
        if isinstance(collected, Skipped):
            scalars = {**collected.scalars, **self.stage.skipped(collected)}
            participants, loss, declined, selected = 0, math.nan, 0, collected.selected
        else:
            updates = self.stage.transform(collected.updates, self.shared, collected.presummed)
            scalars = self._aggregate(round_id, updates, collected)
            samples = sum(u.num_samples for u in updates)
            loss = sum(u.train_loss * u.num_samples for u in updates) / samples if samples else 0.0
            loss = self.stage.train_loss(loss)
            participants, declined = collected.participants, collected.declined
            selected = collected.selected
        self.finish_round(round_id, scalars)
        return RoundRecord(
            round_id=round_id,
            participants=participants,
            selected=selected,
            train_loss=loss,
            bytes_up=self.bytes_up - up_before,
            bytes_down=self.bytes_down - down_before,
            wall_seconds=time.perf_counter() - started,
            scalars=scalars,
            skipped=declined,
            sim_seconds=collected.sim_seconds,
        )

    def collect_planned(
        self, round_id: int, fleet: FleetSnapshot, uplink: Collection | None = None
    ) -> Collected | Skipped:
        """Cohort -> plan -> announce -> collect, from `fleet` (default uplink: the engine's).

        Raises:
            RoundError: nobody to train (and no stage releases an empty round), or the uplink
                failed the round.
        """
        cohort = self.stage.cohort(fleet, self.rng)
        plan = self.strategy.plan_round(round_id, cohort, self.rng)
        if not plan.devices and not self.stage.releases_empty(fleet):
            msg = "no device is online to train"
            raise RoundError(msg, round_id=round_id)
        self.relay.start_round(round_id)
        needed = max(1, math.ceil(self.settings.quorum * len(plan.devices)))
        told = self.stage.device_privacy(fleet, plan.devices)
        if not plan.devices:  # nothing to collect
            logger.info("round %d: the draw is empty: the stages release without updates", round_id)
            return Collected([], participants=0, selected=0)
        request = UplinkRound(round_id, plan, needed, told, len(fleet.online()))
        return (uplink or self.uplink).collect(self, request)

    def _aggregate(
        self, round_id: int, updates: list[ReceivedUpdate], collected: Collected
    ) -> dict[str, float]:
        """Apply `updates` through the guard, then the uplink's and the stages' scalars."""
        if updates:
            scalars, norm_median = self.apply_updates(round_id, updates)
            if collected.reports_norm:
                scalars["update_norm_median"] = norm_median
        else:
            logger.warning("round %d: no update arrived in time; the model is unchanged", round_id)
            scalars = {"aggregate_rejected": 1.0}
        scalars.update(collected.scalars)
        self.stage.release(collected, scalars)  # even if rejected: e.g. DP's noise was drawn
        return scalars

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
        if guarded.aggregate is not None:
            self.shared = guarded.aggregate.shared
        return guarded.scalars(round_id, self.guard_notes), guarded.norm_median

    def finish_round(self, round_id: int, scalars: dict[str, float]) -> None:
        """Round `round_id` is aggregated: publish its model and the fleet's status."""
        self.last_scalars = scalars
        self.round_id = round_id
        self.publish_model(force=self.relay.resends_model)
        self.publish_fleet_status()

    def open_inbox(self, inbox: Collector[ReceivedUpdate] | None) -> None:
        """Collect training updates into `inbox` until closed with None."""
        self.intake.train = inbox
        if inbox is not None:
            self.pass_over_quarantined(inbox)

    def wait_for_answers(self, collector: Collector[Any]) -> bool:
        """Wait until `collector` settles or the round's deadline: whether it settled."""
        online, timeout_s = self.registry.online_ids, self.settings.round_timeout_s
        with self.run_state.waiting(lambda: collector.outstanding(online()), timeout_s) as watch:
            return self.silent.wait(watch.transport(self.transport), collector, online, timeout_s)

    def hold(self, device_id: str, reason: str) -> None:
        """Quarantine a device for the rest of the round."""
        self.quarantine.hold(device_id, reason)

    def count_down(self, sent: int) -> None:
        """Count bytes an uplink path sent to devices itself."""
        self.traffic.bytes_down += sent

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The shared tensors' layout, as updates must have it."""
        return self._specs

    def evaluate(
        self, *, final: bool = False
    ) -> tuple[list[EvaluationReport], dict[str, float | None]]:
        """Ask every online device to evaluate its personalized and the global model."""
        return evaluate_fleet(self, final=final)

    def pass_over_quarantined(self, collector: Collector[Any]) -> None:
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
        announcement = round_announcement(
            run_id=self.run_id,
            round_id=round_id,
            phase=phase,
            plan=plan,
            strategy=self.strategy,
            settings=self.settings,
            relay=self.relay,
            registry=self.registry,
            model_sha256=self.models.sha,
            delta_base_sha256=self.models.delta_base,
            final=final,
            privacy=privacy,
            secure=secure,
            asynchronous=asynchronous,
        )
        self._announcement = encode_frame(announcement)
        self._announcement_expiry = (
            None if final or asynchronous else announcement_expiry(self.settings.round_timeout_s)
        )
        self._broadcast(
            topics.round_announcement(self.settings.fleet),
            self._announcement,
            retain=True,
            expiry_s=self._announcement_expiry,
        )
        asked = announcement.selected or self.registry.online_ids()
        self.traffic.bytes_down += self.registry.count_down(self.models.downloads(asked))
        if phase == "train":
            self.registry.asked(round_id)

    def _broadcast(
        self, topic: str, payload: bytes, *, retain: bool = False, expiry_s: int | None = None
    ) -> None:
        publish_expiring(self.transport, topic, payload, retain=retain, expiry_s=expiry_s)
        self.traffic.bytes_down += self.registry.count_broadcast(len(payload))
