"""What the coordinator does with each kind of device message: validate, then record.

Every handler runs behind `_guarded`: nothing a device sends raises out of it, a failure drops
that one message and counts it against the sender, and a sender over its limit sits out the rest
of the round. The round engine (`coordinator.engine.rounds`) mixes these in; they touch only
what the engine declares below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

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


class DeviceMessages:
    """The engine's intake of device messages (hello, status, update, request, evaluation)."""

    transport: Transport
    settings: EngineSettings
    strategy: Strategy
    registry: FleetRegistry
    models: ModelPublisher
    relay: RelayHook
    offences: Offences
    quarantine: Quarantine
    flaps: FlapWatch
    silent: SilentDevices
    uplink: UplinkPath
    run_id: str
    bytes_up: int
    bytes_down: int
    rejected: int
    _train: Collector[ReceivedUpdate] | None
    _evaluation: Collector[EvaluationReport] | None
    _specs: tuple[TensorSpec, ...]

    def publish_fleet_status(self) -> None:
        """Retain the registry's view (the engine's)."""
        raise NotImplementedError

    def _guarded(self, handler: Callable[[str, bytes], None]) -> Callable[[str, bytes], None]:
        """Nothing a device sends raises out of a handler: a failure drops that one message."""

        def guarded(topic: str, payload: bytes) -> None:
            self.bytes_up += len(payload)
            sender = sender_of(topic)
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
        self.rejected += 1
        self.offences.record(sender, topic, reason)

    def _quarantined(self, sender: str) -> bool:
        """Over its limit this round: the round stops waiting for it, status shows it."""
        if sender == UNKNOWN_SENDER:
            return False
        held, newly = self.quarantine.holds(sender, self.offences.count(sender))
        if newly:
            for collector in (self._train, self._evaluation):
                if collector is not None:
                    collector.decline(sender)
            self.uplink.decline(sender)
            self.publish_fleet_status()
        return held

    def _on_hello(self, topic: str, payload: bytes) -> None:
        hello, _ = device_message(topic, payload, DeviceHello)
        check_hello(hello, self.settings.task, self.settings.guard.max_samples, topic)
        clash = self.registry.on_hello(hello)
        self.models.forget(hello.device_id)
        if self.flaps.note(hello.device_id, clash, hello.instance):
            self.publish_fleet_status()

    def _on_status(self, topic: str, payload: bytes) -> None:
        status, _ = device_message(topic, payload, DeviceStatus)
        self.registry.on_status(status)
        if status.state != "skipped":
            return
        if status.run_id == self.run_id:
            self.uplink.decline(status.device_id, status.round_id)
        for collector in (self._train, self._evaluation):
            if (
                collector is not None
                and status.run_id == self.run_id
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
                self.models.acknowledge(status.device_id)

    def _on_update(self, topic: str, payload: bytes) -> None:
        update, blob = device_message(topic, payload, DeviceUpdate)
        if self.uplink.takes_updates():
            check_claims(update, self.strategy.name, 1, topic)  # its real count is masked
            self.uplink.on_update(update, blob)
            self.models.acknowledge(update.device_id)
            self.registry.on_update(update.device_id, update.round_id, None)
            return
        if update.run_id == self.run_id:  # even after its round closed: a sign of life
            self.silent.heard([update.device_id])
        collector = answered_collector(self._train, update, self.run_id, topic)
        declared = self.registry.declared_samples(update.device_id)
        check_claims(update, self.strategy.name, declared, topic)
        expected = self.relay.update_layout(update.round_id, update.device_id, self._specs)
        delta = unpack_delta(update, blob, expected, self.settings.uplink)
        self.models.acknowledge(update.device_id)
        received = ReceivedUpdate(
            update.device_id,
            update.num_samples,
            update.train_loss,
            delta,
            dict(update.scalars),
            update.within_clip,
        )
        self.registry.on_update(update.device_id, update.round_id, update.train_loss)
        if not collector.offer(update.device_id, received):
            logger.info(
                "ignored duplicate or unrequested update from %s for round %d",
                update.device_id,
                update.round_id,
            )

    def _on_uplink(self, topic: str, payload: bytes) -> None:
        self.uplink.on_message(topic, payload)  # a protocol of the uplink path's own

    def _on_request(self, topic: str, payload: bytes) -> None:
        """Relay the models a device asked for, to its own relay topic (FedeRiCo)."""
        request, _ = device_message(topic, payload, PeerRequest)
        collector: Collector[Any] | None = (
            self._train if request.phase == "train" else self._evaluation
        )
        asked = answered_collector(collector, request, self.run_id, topic).expected
        if request.device_id not in asked:
            msg = f"{request.phase} request from a device not asked this round"
            raise RoundError(msg, device_id=request.device_id, round_id=request.round_id)
        frame = self.relay.answer(request)
        self.transport.publish(topics.relay(self.settings.fleet, request.device_id), frame)
        self.bytes_down += len(frame)

    def _on_evaluation(self, topic: str, payload: bytes) -> None:
        report, _ = device_message(topic, payload, EvaluationReport)
        collector = answered_collector(self._evaluation, report, self.run_id, topic)
        self.models.acknowledge(report.device_id)
        check_evaluation(report, self.settings.metric, self.settings.guard.max_eval_loss, topic)
        collector.offer(report.device_id, report)
