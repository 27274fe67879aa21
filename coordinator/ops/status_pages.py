"""The paged fleet status put back together: a summary and one retained row per device.

The coordinator retains a `FleetSummary` each round and a `FleetRow` per device only when that
row changed (`coordinator.engine.fleet_view.FleetPages`); a reader joins them into the one
`FleetStatus` its tables and pages show.
"""

from __future__ import annotations

from typing import Final

from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import FleetDevice, FleetRow, FleetStatus, FleetSummary

MAX_VIEW_ROWS: Final = 1_000_000
"""Rows a view keeps: only the coordinator can write them, this bounds a reader regardless."""


class PagedFleet:
    """The rows and the summary received so far; `status()` joins them (cached until a change).

    Rows of another coordinator incarnation than the summary's (left retained by an earlier
    run) are not shown. A whole `FleetStatus` (a run directory's `fleet.json`) replaces both.
    """

    def __init__(self) -> None:
        self.summary: FleetSummary | None = None
        self.rows: dict[str, FleetRow] = {}
        self.whole: FleetStatus | None = None
        self._joined: FleetStatus | None = None

    @classmethod
    def of(cls, status: FleetStatus | None) -> PagedFleet:
        """A view of one whole status."""
        paged = cls()
        paged.whole = status
        return paged

    def take_summary(self, summary: FleetSummary) -> None:
        """Keep the round's summary (a whole status given before is dropped)."""
        self.summary, self.whole, self._joined = summary, None, None

    def take_row(self, row: FleetRow) -> bool:
        """Keep `row` (replacing the device's last); False once MAX_VIEW_ROWS are kept."""
        device_id = row.device.device_id
        if device_id not in self.rows and len(self.rows) >= MAX_VIEW_ROWS:
            return False
        self.rows[device_id] = row
        self._joined = None
        return True

    def clear(self, device_id: str) -> None:
        """The coordinator cleared the device's row: it is no longer listed."""
        if self.rows.pop(device_id, None) is not None:
            self._joined = None

    def complete(self) -> bool:
        """Whether a summary and as many of its rows as it counts arrived."""
        summary = self.summary
        if self.whole is not None:
            return True
        if summary is None:
            return False
        rows = sum(r.epoch == summary.epoch for r in self.rows.values())
        return rows >= summary.registered + summary.strangers

    def status(self) -> FleetStatus | None:
        """The whole fleet status (None before a summary): devices by id, then strangers."""
        if self.whole is not None or self.summary is None:
            return self.whole
        if self._joined is None:
            summary = self.summary
            rows = [r for r in self.rows.values() if r.epoch == summary.epoch]
            rows.sort(key=lambda r: (r.stranger, r.device.device_id))
            self._joined = FleetStatus(
                fleet=summary.fleet,
                round_id=summary.round_id,
                devices=tuple(_with_broadcasts(r, summary.broadcast_bytes) for r in rows),
                scalars=summary.scalars,
            )
        return self._joined


def _with_broadcasts(row: FleetRow, broadcast_bytes: int) -> FleetDevice:
    """The row's device with the broadcasts that reached it since the row was settled."""
    if row.broadcast_mark is None or broadcast_bytes <= row.broadcast_mark:
        return row.device
    share = broadcast_bytes - row.broadcast_mark
    return row.device.model_copy(update={"bytes_down": row.device.bytes_down + share})


def retained_pages(status: FleetStatus, epoch: str = "0") -> list[tuple[str, bytes]]:
    """(topic, frame) of the summary and rows the coordinator would retain for `status`.

    For a reader fed a whole status (a replay, a test, a benchmark) the way the broker feeds it.
    """
    held = [d for d in status.devices if d.quarantined]
    summary = FleetSummary(
        fleet=status.fleet,
        epoch=epoch,
        round_id=status.round_id,
        registered=len(status.devices),
        online=sum(d.online for d in status.devices),
        quarantined=len(held),
        flapping=sum(d.flapping for d in status.devices),
        stragglers=sum(d.missed_round == status.round_id for d in status.devices),
        scalars=status.scalars,
    )
    rows = [
        (
            topics.fleet_row(status.fleet, d.device_id),
            FleetRow(fleet=status.fleet, epoch=epoch, device=d),
        )
        for d in status.devices
    ]
    return [(topics.fleet_status(status.fleet), encode_frame(summary))] + [
        (topic, encode_frame(row)) for topic, row in rows
    ]
