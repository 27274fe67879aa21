"""What the dashboard shows, kept current by a feed and read by the web server.

A board is fed messages (from the broker) or files (from a run directory) and hands out one
JSON-ready snapshot; every change bumps a version, which is how the server knows to push.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from coordinator.status import FleetView
from protocols.messages import CoordinatorStatus, FleetStatus, Message, RunHistory


class Board:
    """Thread-safe: a feed thread writes, server requests read."""

    def __init__(self, source: str) -> None:
        self.source = source
        """Where the data comes from, as the page header says (a broker URL or a directory)."""
        self._lock = threading.Lock()
        self._view = FleetView()
        self._history: RunHistory | None = None
        self._finished = False
        self._version = 0
        self._updated = 0.0
        self._cached = ""
        self._cached_version = -1

    @property
    def version(self) -> int:
        """Bumped by every change: a reader holding an older one has something new to show."""
        return self._version

    def apply(self, message: Message) -> None:
        """Take in a message from the fleet's topics (other kinds are ignored)."""
        with self._lock:
            if isinstance(message, RunHistory):
                self._history = message
            elif not self._view.apply(message):
                return
            self._changed()

    def replace_run(
        self,
        *,
        history: RunHistory,
        fleet: FleetStatus | None,
        coordinator: CoordinatorStatus | None,
        finished: bool,
    ) -> None:
        """Take in what a run directory holds now (the feed compares before calling)."""
        with self._lock:
            self._history = history
            self._view.fleet = fleet
            self._view.coordinator = coordinator
            self._finished = finished
            self._changed()

    def snapshot_json(self) -> str:
        """The snapshot as JSON text, made once per version however many pages are open.

        `now` (the server's clock, for "last seen" ages) is current on every call.
        """
        with self._lock:
            version = self._version
            cached = self._cached if self._cached_version == version else None
        if cached is None:
            cached = json.dumps({k: v for k, v in self.snapshot().items() if k != "now"})
            with self._lock:
                self._cached, self._cached_version = cached, version
        return f'{{"now": {time.time()}, {cached[1:]}'

    def snapshot(self) -> dict[str, Any]:
        """Everything the page draws, JSON-ready."""
        with self._lock:
            history = self._history
            coordinator = self._view.coordinator
            return {
                "version": self._version,
                "source": self.source,
                "updated": self._updated,
                "now": time.time(),
                "coordinator": coordinator.model_dump(mode="json") if coordinator else None,
                "finished": self._finished or bool(coordinator and coordinator.state == "finished"),
                "settings": dict(history.settings) if history else {},
                "scalars": dict(self._view.fleet.scalars) if self._view.fleet else {},
                "fleet": self._view.rows(),
                "rounds": [r.model_dump(mode="json") for r in history.rounds] if history else [],
                "devices": [d.model_dump(mode="json") for d in history.devices] if history else [],
            }

    def _changed(self) -> None:
        self._version += 1
        self._updated = time.time()
