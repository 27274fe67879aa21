"""What the dashboard shows, kept current by a feed and read by the web server.

A board is fed what arrives on the fleet's topics (from the broker, or from `serve` itself) or
files (from a run directory) and hands out one JSON-ready snapshot; every change bumps a version,
which is how the server knows to push. What a topic may carry is `FleetView.offer`'s rule.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from coordinator.ops.status import MAX_TRACKED_STATUSES, FleetView
from coordinator.ops.status_pages import PagedFleet
from protocols.messages import CoordinatorStatus, FleetStatus, Message, RunHistory

MAX_BOARD_ROWS = MAX_TRACKED_STATUSES
"""Rows the page gets (every device a view tracks): it draws only the visible ones."""


class Board:
    """Thread-safe: a feed thread writes, server requests read."""

    def __init__(self, source: str, fleet: str = "default") -> None:
        self.source = source
        """Where the data comes from, as the page header says (a broker URL or a directory)."""
        self._lock = threading.Lock()
        self._view = FleetView(fleet)
        self._finished = False
        self._version = 0
        self._updated = 0.0
        self._cached = ""
        self._cached_version = -1
        self._state: tuple[int, dict[str, Any]] = (-1, {})
        self._summary: dict[str, Any] | None = None
        self._notice = ""

    @property
    def version(self) -> int:
        """Bumped by every change: a reader holding an older one has something new to show."""
        return self._version

    def offer(self, topic: str, payload: bytes) -> None:
        """Take in what arrived on one of the fleet's topics, if that topic may carry it.

        A refusal is counted (the next snapshot shows it) without pushing one of its own.
        """
        with self._lock:
            if self._view.offer(topic, payload):
                self._changed()

    def apply(self, message: Message) -> None:
        """Take in a message already checked (other kinds are ignored)."""
        with self._lock:
            if self._view.apply(message):
                self._changed()

    def replace_run(
        self,
        *,
        history: RunHistory,
        fleet: FleetStatus | None,
        coordinator: CoordinatorStatus | None,
        finished: bool,
        summary: dict[str, Any] | None = None,
    ) -> None:
        """Take in what a run directory holds now (the feed compares before calling).

        `summary` is the finished run's summary.json: the page's final cards come from it.
        """
        with self._lock:
            self._view.history = history
            self._view.paged = PagedFleet.of(fleet)
            self._view.coordinator = coordinator
            self._finished = finished
            self._summary = summary
            self._notice = ""
            self._changed()

    def notice(self, text: str) -> None:
        """Say on the page why there is nothing to show yet (e.g. a run directory not made yet)."""
        with self._lock:
            if text != self._notice:
                self._notice = text
                self._changed()

    def snapshot_json(self) -> str:
        """The snapshot as JSON text, made once per version however many pages are open.

        `now` (the server's clock, for "last seen" ages) is current on every call.
        """
        with self._lock:
            version = self._version
            cached = self._cached if self._cached_version == version else None
        if cached is None:
            version, state = self.state()
            cached = json.dumps(state, allow_nan=False)
            with self._lock:
                self._cached, self._cached_version = cached, version
        return f'{{"now": {time.time()}, {cached[1:]}'

    def state(self) -> tuple[int, dict[str, Any]]:
        """The version and the snapshot without its clock, made once per version.

        Shared by every reader (the event streams diff it against what they sent): never
        change it in place.
        """
        with self._lock:
            if self._state[0] == self._version:
                return self._state
        snapshot = self.snapshot()
        del snapshot["now"]
        with self._lock:
            if snapshot["version"] == self._version:
                self._state = (snapshot["version"], snapshot)
        return snapshot["version"], snapshot

    def snapshot(self) -> dict[str, Any]:
        """Everything the page draws, JSON-ready; at most MAX_BOARD_ROWS devices per table."""
        with self._lock:
            history = self._view.history
            coordinator = self._view.coordinator
            results = history.devices if history else ()
            return {
                "version": self._version,
                "source": self.source,
                "updated": self._updated,
                "now": time.time(),
                "coordinator": coordinator.model_dump(mode="json") if coordinator else None,
                "finished": self._finished or bool(coordinator and coordinator.state == "finished"),
                "settings": dict(history.settings) if history else {},
                "scalars": dict(self._view.fleet.scalars) if self._view.fleet else {},
                "fleet": self._view.rows(MAX_BOARD_ROWS),
                "fleet_left_out": self._view.rows_left_out(MAX_BOARD_ROWS),
                "refused": self._view.refused,
                "rounds": [r.model_dump(mode="json") for r in history.rounds] if history else [],
                "devices": [d.model_dump(mode="json") for d in results[:MAX_BOARD_ROWS]],
                "devices_left_out": max(0, len(results) - MAX_BOARD_ROWS),
                "summary": self._summary,
                "notice": self._notice,
            }

    def _changed(self) -> None:
        self._version += 1
        self._updated = time.time()
