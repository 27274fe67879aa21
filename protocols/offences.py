"""Per-device accounting of dropped messages, logged at most once per device per interval.

A device that keeps sending what the coordinator must drop (malformed frames, stale rounds,
claims over its limits) must not flood the log or hide behind it: each drop is counted against
its sender, the first is logged at once, later ones as one line with a count per interval, and
the counts are published in the fleet status (`pfl-coord status`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class _Tally:
    total: int = 0
    unlogged: int = 0
    last_logged: float = float("-inf")
    last_reason: str = ""


class Offences:
    """Thread-safe: handlers record, the engine reads the counts when it publishes the status."""

    def __init__(
        self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._tallies: dict[str, _Tally] = {}
        self._total = 0
        self._lock = threading.Lock()

    def record(self, sender: str, topic: str, reason: str) -> bool:
        """Count one dropped message of `sender`; returns whether a log line was written."""
        now = self._clock()
        with self._lock:
            tally = self._tallies.setdefault(sender, _Tally())
            tally.total += 1
            self._total += 1
            tally.unlogged += 1
            tally.last_reason = reason
            if now - tally.last_logged < self.interval_s:
                return False
            count, tally.unlogged, tally.last_logged = tally.unlogged, 0, now
        who = sender or "the fleet's own topics"
        if count == 1:
            logger.warning("dropped a message from %s on %s: %s", who, topic, reason)
        else:
            logger.warning(
                "dropped %d messages from %s in %.0f s, the last on %s: %s",
                count,
                who,
                self.interval_s,
                topic,
                reason,
            )
        return True

    def count(self, sender: str) -> int:
        """Dropped messages of one sender since the start."""
        with self._lock:
            tally = self._tallies.get(sender)
            return 0 if tally is None else tally.total

    def total(self) -> int:
        """Dropped messages of every sender since the start."""
        with self._lock:
            return self._total

    def counts(self) -> dict[str, int]:
        """Dropped messages per sender since the start."""
        with self._lock:
            return {sender: tally.total for sender, tally in self._tallies.items()}
