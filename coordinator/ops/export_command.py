"""`pfl-coord export`: ask every device for its personalized ONNX model, collect their reports."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from coordinator.ops.identity import tool_client_id
from coordinator.ops.status import FleetView
from protocols import topics
from protocols.codec import decode_frame, encode_frame
from protocols.errors import PflError
from protocols.messages import Command, ExportArguments, ExportReport
from protocols.transport.factory import connect
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)


@dataclass
class FleetExport:
    """The devices the retained fleet status listed, and every export report that arrived.

    `listed` is empty when no coordinator ever published a fleet status; then every device
    that answered within the timeout is the fleet.
    """

    listed: dict[str, bool] = field(default_factory=dict)  # device id -> online
    reports: dict[str, ExportReport] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        """Listed devices that sent no report (offline ones included)."""
        return sorted(set(self.listed) - set(self.reports))

    @property
    def ok(self) -> bool:
        """At least one report, every report ok, every listed device answered."""
        return bool(self.reports) and not self.missing and all(r.ok for r in self.reports.values())

    def rows(self) -> list[dict[str, Any]]:
        """One row per device, listed or answering, sorted by id."""
        rows = []
        for device_id in sorted(set(self.listed) | set(self.reports)):
            report = self.reports.get(device_id)
            if report is None:
                online = self.listed.get(device_id, False)
                reason = "no answer before the timeout" if online else "offline: no answer"
                rows.append({"device": device_id, "ok": False, "answered": False, "error": reason})
                continue
            chosen = report.metrics.get("chosen_global")
            rows.append(
                {
                    "device": device_id,
                    "ok": report.ok,
                    "answered": True,
                    "round": report.round_id,
                    "path": report.path,
                    "size_bytes": report.size_bytes,
                    "sha256": report.sha256,
                    "parity_max_abs_diff": report.parity_max_abs_diff,
                    "metric": report.metrics.get("exported"),
                    "chosen": None if chosen is None else ("global" if chosen else "personalized"),
                    "metrics": dict(report.metrics),
                    "error": report.error,
                }
            )
        return rows

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready mapping for `--json`."""
        return {
            "ok": self.ok,
            "devices": self.rows(),
            "missing": self.missing,
            "total_bytes": sum(r.size_bytes for r in self.reports.values() if r.ok),
        }


def request_exports(
    broker: BrokerSettings,
    fleet: str,
    request: ExportArguments,
    *,
    timeout_s: float = 60.0,
    listen_s: float = 1.5,
) -> FleetExport:
    """Publish the export command to every device and collect the reports.

    The retained fleet status (read for up to `listen_s` seconds first) says which devices to
    wait for; collection ends when every online listed device answered, or after `timeout_s`.
    Reports carry no tensors; the files stay on the devices.

    Raises:
        BrokerConnectionError: the broker cannot be reached.
        ToolAccountError: `broker` names the coordinator's account.
    """
    client_id = tool_client_id(broker, "export")
    result = FleetExport()
    lock = threading.Lock()
    view = FleetView(fleet)  # the retained fleet summary and rows, as `pfl-coord status` reads

    def on_status(topic: str, payload: bytes) -> None:
        with lock:
            view.offer(topic, payload)

    def on_message(topic: str, payload: bytes) -> None:
        try:
            message, _ = decode_frame(payload)
            ref = topics.parse_topic(topic)
        except PflError as error:
            logger.warning("ignored a malformed message on %s: %s", topic, error)
            return
        with lock:
            if isinstance(message, ExportReport) and message.device_id == ref.device_id:
                result.reports[message.device_id] = message

    with connect(broker, client_id, clean_start=True) as transport:
        transport.subscribe(topics.device_subscription(fleet, "export-report"), on_message)
        transport.subscribe(topics.fleet_status(fleet), on_status)
        transport.subscribe(topics.fleet_row(fleet), on_status)

        def listed() -> bool:
            with lock:
                return view.paged.complete()

        transport.wait_until(listed, listen_s)
        with lock:
            status = view.fleet
            if status is not None:
                result.listed = {d.device_id: d.online for d in status.devices}
        waiting = {device_id for device_id, online in result.listed.items() if online}
        command = Command(action="export", export=request)
        transport.publish(topics.command(fleet), encode_frame(command))
        logger.info("export requested from fleet %s; waiting for %d device(s)", fleet, len(waiting))

        def done() -> bool:
            with lock:
                return bool(waiting) and waiting <= set(result.reports)

        transport.wait_until(done, timeout_s)
    with lock:
        return FleetExport(dict(result.listed), dict(result.reports))
