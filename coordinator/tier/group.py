"""One aggregator of the tier: the device side of a round for its group, one partial upstream.

It reads the coordinator's round announcement and tier plan (retained, so a restarted aggregator
picks up the round in progress), takes its group's updates with the checks the coordinator's
intake applies (the sender is the topic's device, this run and round, asked, the fleet's
algorithm, at most the samples its hello declared, as the plan lists them, the run's codec and
layout, finite values), clips each to the plan's norm, and keeps sum_i w_i delta_i in float64
in device-id order. It sends the
partial when every asked member answered or declined, or when the coordinator closes the round:
the coordinator owns every deadline, so the aggregator holds no clock and no thread. A member
that sends more bad messages than `quarantine_after` in a round is left out of that round.

A secure round (the announcement carries one) runs secure aggregation within the group instead
(`coordinator.tier.secure_group`): the partial is the group's unmasked sum, sent when the
protocol's phases end, whose deadlines it keeps itself.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from coordinator.engine.intake import check_claims, device_message, unpack_delta
from coordinator.stages.secure.unmask import SecureSum
from coordinator.tier import wire
from coordinator.tier.secure_group import GroupCohort, GroupSecureRound
from protocols import topics
from protocols.codec import decode_frame
from protocols.errors import PflError, RoundError, describe
from protocols.messages import DeviceStatus, DeviceUpdate, RoundAnnouncement, TensorSpec
from protocols.offences import Offences
from protocols.privacy import clip_to_norm
from protocols.transport.base import Transport
from protocols.transport.inbound import sender_of

logger = logging.getLogger(__name__)


def hashed_member(index: int, groups: int) -> Callable[[str], bool]:
    """Group `index` of `groups` by a hash of the device id (stable across processes)."""

    def member(device_id: str) -> bool:
        digest = hashlib.sha256(device_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") % groups == index

    return member


def listed_member(devices: Sequence[str]) -> Callable[[str], bool]:
    """A site's explicit device list."""
    listed = frozenset(devices)
    return listed.__contains__


@dataclass
class _Round:
    """The round being collected: who was asked, what came in."""

    plan: wire.TierPlan
    announcement: RoundAnnouncement
    expected: frozenset[str]
    updates: dict[str, tuple[float, int, float, float | None, dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )
    declined: set[str] = field(default_factory=set)
    sent: bool = False
    partial_devices: int = 0
    secure: GroupSecureRound | None = None


@dataclass
class GroupAggregator:
    """Serves the devices `member` accepts; sends their partial aggregate as `name`."""

    transport: Transport
    fleet: str
    name: str
    member: Callable[[str], bool]
    quarantine_after: int = 3
    max_frame_bytes: int = 256 * 1024 * 1024
    group: str = ""
    """Which devices `member` accepts, in words, for `pfl-coord status`."""
    offences: Offences = field(default_factory=Offences)
    partials_sent: int = 0
    _plan: wire.TierPlan | None = None
    _announcement: RoundAnnouncement | None = None
    _round: _Round | None = None
    _held: set[str] = field(default_factory=set)
    _baseline: dict[str, int] = field(default_factory=dict)
    _offline: set[str] = field(default_factory=set)
    _secure: GroupSecureRound | None = None
    _sending: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        """Subscribe to the round's plan, announcement, close, and the devices' messages."""
        fleet, subscribe = self.fleet, self.transport.subscribe
        subscribe(wire.plan_topic(fleet), self._guarded(self._on_plan))
        subscribe(wire.close_topic(fleet), self._guarded(self._on_close))
        subscribe(topics.round_announcement(fleet), self._guarded(self._on_announcement))
        for kind, handler in (
            ("status", self._on_status),
            ("update", self._on_update),
            ("secagg", self._on_secagg),
        ):
            pattern = topics.device_subscription(fleet, kind)  # type: ignore[arg-type]
            subscribe(pattern, self._guarded(handler, device=True))
        self.publish_status()

    def status(self, state: Literal["online", "offline"] = "online") -> wire.AggregatorStatus:
        """Its group, and the last round it collected (for `pfl-coord status`)."""
        current = self._round
        return wire.AggregatorStatus(
            aggregator=self.name,
            group=self.group,
            state=state,
            run_id=current.plan.run_id if current else None,
            round_id=current.plan.round_id if current else None,
            asked=len(current.expected) if current else 0,
            devices=current.partial_devices if current else 0,
            partial_sent=current.sent if current else False,
            partials_sent=self.partials_sent,
        )

    def publish_status(self) -> None:
        """Retain `status()` on its topic."""
        topic = wire.status_topic(self.fleet, self.name)
        self.transport.publish(topic, wire.encode(self.status()), retain=True)

    def _guarded(
        self, handler: Callable[[str, bytes], None], *, device: bool = False
    ) -> Callable[[str, bytes], None]:
        def guarded(topic: str, payload: bytes) -> None:
            sender = sender_of(topic) if device else "coordinator"
            if device and not self.member(sender):
                return  # another group's device
            try:
                handler(topic, payload)
            except PflError as error:
                self._drop(sender, topic, str(error))
            except Exception as error:  # an input no validator caught: count it, stay up
                logger.debug("aggregator %s: failure on %s", self.name, topic, exc_info=True)
                self._drop(sender, topic, describe(error))

        return guarded

    def _drop(self, sender: str, topic: str, reason: str) -> None:
        self.offences.record(sender, topic, reason)
        current = self._round
        if (
            current is not None
            and sender in current.expected
            and self.offences.count(sender) - self._baseline.get(sender, 0) >= self.quarantine_after
        ):
            self._held.add(sender)
            current.updates.pop(sender, None)
            self._decline(sender)

    def _on_plan(self, topic: str, payload: bytes) -> None:
        plan, _ = wire.decode(payload, self.max_frame_bytes)
        if not isinstance(plan, wire.TierPlan):
            msg = f"expected a tier plan on {topic}"
            raise RoundError(msg, topic=topic)
        self._plan = plan
        self._begin()

    def _on_announcement(self, topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        if not isinstance(announcement, RoundAnnouncement):
            msg = f"expected a round announcement on {topic}"
            raise RoundError(msg, topic=topic)
        if announcement.phase == "train":
            self._announcement = announcement
            self._begin()

    def _begin(self) -> None:
        """Start collecting once the plan and the announcement name the same new round."""
        plan, announcement, current = self._plan, self._announcement, self._round
        if plan is None or announcement is None:
            return
        same = plan.run_id == announcement.run_id and plan.round_id == announcement.round_id
        if not same or (
            current is not None
            and (current.plan.run_id, current.plan.round_id) == (plan.run_id, plan.round_id)
        ):
            return
        expected = frozenset(d for d in announcement.selected if self.member(d))
        self._held.clear()
        self._baseline = self.offences.counts()
        current = _Round(plan, announcement, expected)
        self._round = current
        logger.info(
            "aggregator %s: round %d asks %d of its devices%s",
            self.name,
            plan.round_id,
            len(expected),
            " (secure aggregation within the group)" if announcement.secure else "",
        )
        self.publish_status()
        if announcement.secure is None:
            self._maybe_send()
            return
        if self._secure is None:
            self._secure = GroupSecureRound(self.transport, self.fleet, self._blame)
        current.secure = self._secure
        cohort = GroupCohort(
            announcement,
            tuple(sorted(expected)),
            plan.specs,
            plan.train_timeout_s,
            lambda: expected - self._offline,
        )
        current.secure.start(cohort, lambda total, why: self._send_secure(current, total, why))

    def _blame(self, device_id: str, reason: str) -> None:
        self.offences.record(device_id, topics.device(self.fleet, device_id, "secagg"), reason)

    def _on_close(self, topic: str, payload: bytes) -> None:
        close, _ = wire.decode(payload, self.max_frame_bytes)
        current = self._round
        if not isinstance(close, wire.TierClose) or current is None or current.secure is not None:
            return  # a secure round's phases keep their own deadlines
        if (close.run_id, close.round_id) == (current.plan.run_id, current.plan.round_id):
            self._send(current)

    def _on_status(self, topic: str, payload: bytes) -> None:
        status, _ = device_message(topic, payload, DeviceStatus)
        if status.state == "offline":
            self._offline.add(status.device_id)
        else:
            self._offline.discard(status.device_id)
        current = self._round
        if current is None or status.state not in ("skipped", "offline"):
            return
        if status.state == "offline" or (
            status.run_id == current.plan.run_id and status.round_id == current.plan.round_id
        ):
            self._decline(status.device_id)

    def _decline(self, device_id: str) -> None:
        current = self._round
        if current is not None and current.secure is not None:
            current.secure.decline(device_id, current.plan.round_id)
        elif current is not None and device_id in current.expected:
            if device_id not in current.updates:
                current.declined.add(device_id)
            self._maybe_send()

    def _on_update(self, topic: str, payload: bytes) -> None:
        update, blob = device_message(topic, payload, DeviceUpdate)
        current = self._round
        if current is None or update.run_id != current.plan.run_id:
            msg = "update for no round this aggregator collects"
            raise RoundError(msg, device_id=update.device_id, topic=topic)
        plan = current.plan
        if update.round_id != plan.round_id or update.device_id not in current.expected:
            msg = "stale or unrequested update"
            raise RoundError(msg, device_id=update.device_id, round_id=update.round_id)
        if update.device_id in current.updates or update.device_id in self._held:
            msg = "a second update, or one from a device held this round"
            raise RoundError(msg, device_id=update.device_id, round_id=update.round_id)
        if current.secure is not None:  # masked: its claims are in the sum, checked there
            current.secure.on_update(update, blob)
            return
        check_claims(update, plan.algorithm, plan.declared.get(update.device_id), topic)
        delta = unpack_delta(update, blob, plan.specs, current.announcement.uplink)
        clipped = clip_to_norm(delta, plan.clip_norm)
        weight = 1.0 if plan.equal_weights else float(update.num_samples)
        current.updates[update.device_id] = (
            weight,
            update.num_samples,
            update.train_loss,
            update.within_clip,
            wire.as_float64(clipped),
        )
        current.declined.discard(update.device_id)
        self._maybe_send()

    def _on_secagg(self, topic: str, payload: bytes) -> None:
        current = self._round
        if current is None or current.secure is None:
            msg = "secure aggregation message, but no secure round is collected here"
            raise RoundError(msg, topic=topic)
        current.secure.on_message(topic, payload)

    def _send_secure(self, current: _Round, total: SecureSum | None, why: str) -> None:
        """The group's unmasked sum as its partial (an empty one: the group has none)."""
        if total is None:
            logger.warning("aggregator %s: round %d: %s", self.name, current.plan.round_id, why)
            self._publish(current, (), {s.name: _zeros(s) for s in current.plan.specs}, 0, 0, None)
            return
        weight = float(round(total.weight))  # integer weights, read back from fixed point
        loss = (total.loss or 0.0) * weight
        sums = wire.as_float64(total.total)
        self._publish(current, total.survivors, sums, weight, loss, total.within)

    def _maybe_send(self) -> None:
        current = self._round
        if current is not None and len(current.updates) + len(current.declined) >= len(
            current.expected
        ):
            self._send(current)

    def _send(self, current: _Round) -> None:
        """The partial of `current`'s updates, summed in device-id order."""
        plan = current.plan
        devices = tuple(sorted(current.updates))
        sums = {s.name: _zeros(s) for s in plan.specs}
        weight, loss_sum, bits = 0.0, 0.0, []
        for device_id in devices:
            w, n, loss, within, delta = current.updates[device_id]
            for name, tensor in delta.items():
                sums[name].add_(tensor, alpha=w)
            weight, loss_sum = weight + w, loss_sum + loss * n
            bits.append(within)
        within_sum = (
            sum(b for b in bits if b is not None) if any(b is not None for b in bits) else None
        )
        samples = sum(current.updates[d][1] for d in devices)
        self._publish(current, devices, sums, weight, loss_sum, within_sum, samples)

    def _publish(
        self,
        current: _Round,
        devices: tuple[str, ...],
        sums: dict[str, torch.Tensor],
        weight: float,
        loss_sum: float,
        within_clip: float | None,
        samples: int | None = None,
    ) -> None:
        """Send `current`'s partial: once per round (the coordinator takes only the first).

        `samples` None: the sum's weight stands for the samples (a secure sum hides counts).
        """
        with self._sending:
            if current.sent:
                return
            current.sent, current.partial_devices = True, len(devices)
        plan = current.plan
        partial = wire.PartialAggregate(
            run_id=plan.run_id,
            round_id=plan.round_id,
            aggregator=self.name,
            devices=devices,
            weight=weight,
            loss_sum=loss_sum,
            samples=round(weight) if samples is None else samples,
            within_clip=within_clip,
        )
        self.transport.publish(
            wire.partial_topic(self.fleet, self.name), wire.encode(partial, sums)
        )
        self.partials_sent += 1
        self.publish_status()
        logger.info(
            "aggregator %s: round %d partial of %d devices (%d declined)",
            self.name,
            plan.round_id,
            len(devices),
            len(current.declined),
        )


def _zeros(spec: TensorSpec) -> torch.Tensor:
    return torch.zeros(spec.shape, dtype=torch.float64)
