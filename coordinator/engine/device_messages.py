"""What the coordinator does with each kind of device message: validate, then record.

Every handler runs behind `_guarded`: nothing a device sends raises out of it, a failure drops
that one message and counts it against the sender, and a sender over its limit sits out the rest
of the round. The round engine (`coordinator.engine.rounds`) holds a `DeviceIntake`; it reads
the engine through `IntakeHost` and records into the collaborators it was given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.engine.downlink import ModelPublisher
from coordinator.engine.flapping import FlapWatch
from coordinator.engine.intake import (
    Collector,
    answered_collector,
    check_claims,
    check_evaluation,
    check_hello,
    device_message,
    unpack_delta,
)
from coordinator.engine.quarantine import Quarantine
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import EngineSettings
from coordinator.engine.silence import SilentDevices
from coordinator.stages.relay import RelayHook
from coordinator.stages.uplink import UplinkPath
from coordinator.strategies.base import ReceivedUpdate, Strategy
from protocols import topics
from protocols.errors import PflError, RoundError, describe
from protocols.messages import (
    DeviceHello,
    DeviceStatus,
    DeviceUpdate,
    EvaluationReport,
    PeerRequest,
    TensorSpec,
)
from protocols.offences import Offences
from protocols.transport.base import Transport
from protocols.transport.inbound import UNKNOWN_SENDER, sender_of

logger = logging.getLogger(__name__)


@dataclass
class Traffic:
    """What crossed the wire for the engine: payload bytes each way, messages dropped."""

    bytes_up: int = 0
    bytes_down: int = 0
    rejected: int = 0


class IntakeHost(Protocol):
    """What the intake reads of the engine that may change during a run."""

    run_id: str
    settings: EngineSettings
    strategy: Strategy
    relay: RelayHook
    uplink: UplinkPath

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The shared tensors' layout."""
        ...

    def publish_fleet_status(self) -> None:
        """Retain the registry's view."""
        ...


@dataclass
class IntakeParts:
    """The engine's collaborators the intake records into (fixed for a run)."""

    transport: Transport
    registry: FleetRegistry
    models: ModelPublisher
    offences: Offences
    quarantine: Quarantine
    flaps: FlapWatch
    silent: SilentDevices
    traffic: Traffic


class DeviceIntake:
    """The engine's intake of device messages (hello, status, update, request, evaluation).

    `train` and `evaluation` are the inboxes the engine has open (None: none).
    """

    def __init__(self, host: IntakeHost, parts: IntakeParts) -> None:
        self.host = host
        self.parts = parts
        self.train: Collector[ReceivedUpdate] | None = None
        self.evaluation: Collector[EvaluationReport] | None = None

    def handlers(self) -> dict[topics.DeviceTopicKind, Callable[[str, bytes], None]]:
        """Each device topic's handler, guarded (`guarded`)."""
        handlers: dict[topics.DeviceTopicKind, Callable[[str, bytes], None]] = {
            "hello": self._on_hello,
            "status": self._on_status,
            "update": self._on_update,
            "request": self._on_request,
            "evaluation": self._on_evaluation,
            "secagg": self._on_uplink,
        }
        return {kind: self.guarded(handler) for kind, handler in handlers.items()}

    def guarded(self, handler: Callable[[str, bytes], None]) -> Callable[[str, bytes], None]:
        """Nothing a device sends raises out of a handler: a failure drops that one message."""

        def guarded(topic: str, payload: bytes) -> None:
            self.parts.traffic.bytes_up += len(payload)
            sender = sender_of(topic)
            self.parts.registry.count_up(sender, len(payload))
            if self._quarantined(sender):
                self._drop(sender, topic, "quarantined for the rest of the round")
                return
            try:
                handler(topic, payload)
            except PflError as error:
                self._drop(sender, topic, str(error))
            except Exception as error:  # an input no validator caught: count it, stay up
                logger.debug("handler failure on %s", topic, exc_info=True)
                self._drop(sender, topic, describe(error))

        return guarded

    def _drop(self, sender: str, topic: str, reason: str) -> None:
        self.parts.traffic.rejected += 1
        self.parts.offences.record(sender, topic, reason)

    def _quarantined(self, sender: str) -> bool:
        """Over its limit this round: the round stops waiting for it, status shows it."""
        if sender == UNKNOWN_SENDER:
            return False
        held, newly = self.parts.quarantine.holds(sender, self.parts.offences.count(sender))
        if newly:
            for collector in (self.train, self.evaluation):
                if collector is not None:
                    collector.decline(sender)
            self.host.uplink.decline(sender)
            self.host.publish_fleet_status()
        return held

    def _on_hello(self, topic: str, payload: bytes) -> None:
        hello, _ = device_message(topic, payload, DeviceHello)
        check_hello(hello, self.host.settings.task, self.host.settings.guard.max_samples, topic)
        clash = self.parts.registry.on_hello(hello)
        self.parts.models.forget(hello.device_id)
        if self.parts.flaps.note(hello.device_id, clash, hello.instance):
            self.host.publish_fleet_status()

    def _on_status(self, topic: str, payload: bytes) -> None:
        status, _ = device_message(topic, payload, DeviceStatus)
        self.parts.registry.on_status(status)
        if status.state != "skipped":
            return
        if status.run_id == self.host.run_id:
            self.host.uplink.decline(status.device_id, status.round_id)
        for collector in (self.train, self.evaluation):
            if (
                collector is not None
                and status.run_id == self.host.run_id
                and status.round_id is not None
                and collector.asks(status.device_id, status.round_id)
            ):
                logger.info(
                    "device %s skipped the %s of round %s: %s",
                    status.device_id,
                    collector.phase,
                    status.round_id,
                    status.detail,
                )
                collector.decline(status.device_id)
                self.parts.models.acknowledge(status.device_id)

    def _on_update(self, topic: str, payload: bytes) -> None:
        update, blob = device_message(topic, payload, DeviceUpdate)
        if self.host.uplink.takes_updates():
            check_claims(update, self.host.strategy.name, 1, topic)  # its real count is masked
            self.host.uplink.on_update(update, blob)
            self.parts.models.acknowledge(update.device_id)
            self.parts.registry.on_update(update.device_id, update.round_id, None)
            return
        if update.run_id == self.host.run_id:  # even after its round closed: a sign of life
            self.parts.silent.heard([update.device_id])
        collector = answered_collector(self.train, update, self.host.run_id, topic)
        declared = self.parts.registry.declared_samples(update.device_id)
        check_claims(update, self.host.strategy.name, declared, topic)
        expected = self.host.relay.update_layout(update.round_id, update.device_id, self.host.specs)
        delta = unpack_delta(update, blob, expected, self.host.settings.uplink)
        self.parts.models.acknowledge(update.device_id)
        received = ReceivedUpdate(
            update.device_id,
            update.num_samples,
            update.train_loss,
            delta,
            dict(update.scalars),
            update.within_clip,
        )
        self.parts.registry.on_update(update.device_id, update.round_id, update.train_loss)
        if not collector.offer(update.device_id, received):
            logger.info(
                "ignored duplicate or unrequested update from %s for round %d",
                update.device_id,
                update.round_id,
            )

    def _on_uplink(self, topic: str, payload: bytes) -> None:
        self.host.uplink.on_message(topic, payload)  # a protocol of the uplink path's own

    def _on_request(self, topic: str, payload: bytes) -> None:
        """Relay the models a device asked for, to its own relay topic (FedeRiCo)."""
        request, _ = device_message(topic, payload, PeerRequest)
        collector: Collector[Any] | None = (
            self.train if request.phase == "train" else self.evaluation
        )
        asked = answered_collector(collector, request, self.host.run_id, topic).expected
        if request.device_id not in asked:
            msg = f"{request.phase} request from a device not asked this round"
            raise RoundError(msg, device_id=request.device_id, round_id=request.round_id)
        frame = self.host.relay.answer(request)
        self.parts.transport.publish(
            topics.relay(self.host.settings.fleet, request.device_id), frame
        )
        self.parts.traffic.bytes_down += len(frame)
        self.parts.registry.count_down({request.device_id: len(frame)})

    def _on_evaluation(self, topic: str, payload: bytes) -> None:
        report, _ = device_message(topic, payload, EvaluationReport)
        collector = answered_collector(self.evaluation, report, self.host.run_id, topic)
        self.parts.models.acknowledge(report.device_id)
        check_evaluation(
            report, self.host.settings.metric, self.host.settings.guard.max_eval_loss, topic
        )
        collector.offer(report.device_id, report)
