"""A snapshot of a fleet from its retained messages, for `pfl-coord status` and the dashboard."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from coordinator.ops.identity import tool_client_id
from coordinator.ops.status_pages import PagedFleet
from coordinator.ops.status_tier import AggregatorViews
from coordinator.ops.view_intake import view_message, view_topic
from protocols import topics
from protocols.errors import PflError
from protocols.messages import (
    CoordinatorStatus,
    DeviceStatus,
    FleetRow,
    FleetStatus,
    FleetSummary,
    Message,
    RunHistory,
)
from protocols.transport.factory import connect
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)

MAX_SHOWN_DEVICES: Final = 1000
"""Rows a view shows (by device id); it says how many more there are."""
MAX_TRACKED_STATUSES: Final = 10_000
"""Device statuses a view keeps; statuses of further ids are refused."""
_LOGGED_TOPICS: Final = 1000
"""Topics whose first refused message is logged as a warning (later ones at debug)."""


@dataclass
class FleetView:
    """What the broker retained: the coordinator's status, its fleet summary, device statuses.

    `offer` is the door for what arrives on a topic: only what that topic may carry gets in
    (`coordinator.ops.view_intake`); `refused` counts the rest.
    """

    name: str = "default"
    """The fleet's name: topics of other fleets are refused."""
    coordinator: CoordinatorStatus | None = None
    paged: PagedFleet = field(default_factory=PagedFleet)
    """The coordinator's fleet summary and its per-device rows (`fleet` joins them)."""
    devices: dict[str, DeviceStatus] = field(default_factory=dict)
    history: RunHistory | None = None
    aggregators: AggregatorViews = field(default_factory=AggregatorViews)
    """The aggregator tier's retained statuses (none without a tier)."""
    refused: int = 0
    _logged: set[str] = field(default_factory=set, repr=False)

    def offer(self, topic: str, payload: bytes, now: float | None = None) -> bool:
        """Take in what arrived on `topic` if that topic may carry it; whether it was taken.

        Other topics are passed over without a count (nothing decoded).
        """
        taken = self.aggregators.offer(self.name, topic, payload)
        if taken is not None:
            if taken:
                return True
            self._refuse(topic, "not this aggregator's status")
            return False
        ref = view_topic(self.name, topic)
        if ref is None:
            return False
        if ref.kind == "fleet-row" and not payload and ref.device_id is not None:
            self.paged.clear(ref.device_id)  # the coordinator no longer lists the device
            return True
        try:
            message = view_message(self.name, topic, payload, time.time() if now is None else now)
        except PflError as error:
            self._refuse(topic, str(error))
            return False
        if not self.apply(message):
            self._refuse(topic, "more device statuses (or rows) than a view keeps")
            return False
        return True

    def _refuse(self, topic: str, reason: str) -> None:
        self.refused += 1
        first = topic not in self._logged and len(self._logged) < _LOGGED_TOPICS
        if first:
            self._logged.add(topic)
        logger.log(logging.WARNING if first else logging.DEBUG, "ignored %s: %s", topic, reason)

    @property
    def fleet(self) -> FleetStatus | None:
        """The coordinator's fleet status: its summary joined with the rows (None: no summary)."""
        return self.paged.status()

    def device_ids(self) -> list[str]:
        """Every device either source names, sorted."""
        summary = {d.device_id for d in self.fleet.devices} if self.fleet else set()
        return sorted(summary | set(self.devices))

    def rows_left_out(self, limit: int = MAX_SHOWN_DEVICES) -> int:
        """Devices beyond the `limit` that `rows` shows."""
        return max(0, len(self.device_ids()) - limit)

    def rows(self, limit: int = MAX_SHOWN_DEVICES) -> list[dict[str, Any]]:
        """A row per device (the first `limit` by id).

        The coordinator's view, completed by the device's own status.
        """
        summary = {d.device_id: d for d in self.fleet.devices} if self.fleet else {}
        rows = []
        for device_id in self.device_ids()[:limit]:
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
                    "bytes_up": known.bytes_up if known else None,
                    "bytes_down": known.bytes_down if known else None,
                    "round_seconds": known.round_seconds if known else None,
                    "missed_deadlines": known.missed_deadlines if known else 0,
                    "memory_plan": known.memory_plan.model_dump(mode="json")
                    if known and known.memory_plan
                    else None,
                    "eligibility": known.eligibility.model_dump(mode="json") if known else None,
                }
            )
        return rows

    def stragglers(self) -> list[str]:
        """The devices that let the last round's deadline pass while connected (all, by id)."""
        if self.fleet is None:
            return []
        last = self.fleet.round_id
        return [d.device_id for d in self.fleet.devices if d.missed_round == last]

    def apply(self, message: Message) -> bool:
        """Take in a status message already checked; whether it was kept.

        Other kinds are left, and so is the status of a new device once MAX_TRACKED_STATUSES
        are kept.
        """
        if isinstance(message, CoordinatorStatus):
            self.coordinator = message
        elif isinstance(message, FleetSummary):
            self.paged.take_summary(message)
        elif isinstance(message, FleetRow):
            return self.paged.take_row(message)
        elif isinstance(message, FleetStatus):
            self.paged = PagedFleet.of(message)
        elif isinstance(message, RunHistory):
            self.history = message
        elif isinstance(message, DeviceStatus) and (
            message.device_id in self.devices or len(self.devices) < MAX_TRACKED_STATUSES
        ):
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
            "devices_left_out": self.rows_left_out(),
            "aggregators": self.aggregators.rows(),
            "stragglers": self.stragglers(),
            "refused": self.refused,
        }


def watch_fleet(
    broker: BrokerSettings,
    fleet: str,
    offer: Callable[[str, bytes], None],
    purpose: str,
    *,
    history: bool = False,
) -> MqttTransport:
    """An operator client handing `offer` every retained status of `fleet` with its topic.

    With `history`, the run's history too. The caller closes the transport. `offer` decides what
    the topic may carry (`FleetView.offer`).

    Raises:
        BrokerConnectionError: the broker cannot be reached.
        ToolAccountError: `broker` names the coordinator's account.
    """
    client_id = tool_client_id(broker, purpose)
    transport = connect(broker, client_id, clean_start=True)
    patterns = [
        topics.coordinator_status(fleet),
        topics.fleet_status(fleet),
        topics.fleet_row(fleet),
        topics.device_subscription(fleet, "status"),
        topics.aggregator_status(fleet),
    ]
    if history:
        patterns.append(topics.run_history(fleet))
    for pattern in patterns:
        transport.subscribe(pattern, offer)
    return transport


def collect_fleet_view(broker: BrokerSettings, fleet: str, listen_s: float = 1.5) -> FleetView:
    """Listen to the fleet's retained topics for `listen_s` seconds.

    Raises:
        BrokerConnectionError: the broker cannot be reached.
    """
    view = FleetView(fleet)
    lock = threading.Lock()

    def take(topic: str, payload: bytes) -> None:
        with lock:
            view.offer(topic, payload)

    with watch_fleet(broker, fleet, take, "status"):
        time.sleep(listen_s)
    return view
