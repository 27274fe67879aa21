"""A snapshot of a fleet from its retained messages, for `pfl-coord status`."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocols import topics
from protocols.codec import decode_frame
from protocols.errors import PflError
from protocols.messages import CoordinatorStatus, DeviceStatus, FleetStatus, Message
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)


@dataclass
class FleetView:
    """What the broker retained: the coordinator's status, its fleet summary, device statuses."""

    coordinator: CoordinatorStatus | None = None
    fleet: FleetStatus | None = None
    devices: dict[str, DeviceStatus] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """One row per device: the coordinator's view, completed by the device's own status."""
        summary = {d.device_id: d for d in self.fleet.devices} if self.fleet else {}
        rows = []
        for device_id in sorted(set(summary) | set(self.devices)):
            known, status = summary.get(device_id), self.devices.get(device_id)
            online = (
                status.state != "offline" if status is not None else bool(known and known.online)
            )
            rows.append(
                {
                    "device": device_id,
                    "online": online,
                    "state": status.state if status is not None else None,
                    "last_seen": max(
                        known.last_seen if known else 0.0, status.sent_at if status else 0.0
                    ),
                    "round": known.round_id
                    if known and known.round_id is not None
                    else (status.round_id if status else None),
                    "last_loss": known.last_loss
                    if known and known.last_loss is not None
                    else (status.last_loss if status else None),
                    "num_train_samples": known.num_train_samples if known else None,
                    "detail": (status.detail if status else "") or (known.detail if known else ""),
                    "dropped": known.dropped if known else 0,
                    "quarantined": known.quarantined if known else False,
                    "flapping": known.flapping if known else False,
                    "rounds_taken": known.rounds_taken if known else 0,
                    "declines": known.declines if known else 0,
                    "last_decline": known.last_decline if known else "",
                    "memory_plan": known.memory_plan.model_dump(mode="json")
                    if known and known.memory_plan
                    else None,
                    "eligibility": known.eligibility.model_dump(mode="json") if known else None,
                }
            )
        return rows

    def apply(self, message: Message) -> bool:
        """Take in a retained status message; whether it was one (other kinds are left)."""
        if isinstance(message, CoordinatorStatus):
            self.coordinator = message
        elif isinstance(message, FleetStatus):
            self.fleet = message
        elif isinstance(message, DeviceStatus):
            self.devices[message.device_id] = message
        else:
            return False
        return True

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready mapping for `--json`."""
        return {
            "coordinator": self.coordinator.model_dump(mode="json") if self.coordinator else None,
            "round_id": self.fleet.round_id if self.fleet else None,
            "scalars": dict(self.fleet.scalars) if self.fleet else {},
            "devices": self.rows(),
        }


def watch_fleet(
    broker: BrokerSettings,
    fleet: str,
    on_message: Callable[[Message], None],
    purpose: str,
    *,
    history: bool = False,
) -> MqttTransport:
    """An operator client handing `on_message` every retained status of `fleet` (decoded).

    With `history`, the run's history too. The caller closes the transport. Malformed messages
    are logged and skipped.

    Raises:
        BrokerConnectionError: the broker cannot be reached.
    """

    def decode(topic: str, payload: bytes) -> None:
        try:
            message, _ = decode_frame(payload)
        except PflError as error:
            logger.warning("ignored a malformed message on %s: %s", topic, error)
            return
        on_message(message)

    client_id = f"{topics.RESERVED_PREFIX}{purpose}-{uuid.uuid4().hex[:12]}"
    transport = MqttTransport(broker, client_id, clean_start=True)
    patterns = [
        topics.coordinator_status(fleet),
        topics.fleet_status(fleet),
        topics.device_subscription(fleet, "status"),
    ]
    if history:
        patterns.append(topics.run_history(fleet))
    for pattern in patterns:
        transport.subscribe(pattern, decode)
    return transport


def collect_fleet_view(broker: BrokerSettings, fleet: str, listen_s: float = 1.5) -> FleetView:
    """Listen to the fleet's retained topics for `listen_s` seconds.

    Raises:
        BrokerConnectionError: the broker cannot be reached.
    """
    view = FleetView()
    lock = threading.Lock()

    def take(message: Message) -> None:
        with lock:
            view.apply(message)

    with watch_fleet(broker, fleet, take, "status"):
        time.sleep(listen_s)
    return view
