"""Device ids that keep rejoining: most often two devices running under one id.

Each of two agents with one id takes the broker session from the other and says hello again,
every second or two, so neither ever stays. The coordinator cannot tell them apart, but it sees
the hellos: one id rejoining `threshold` times within `window_s` is flapping, which the log and
`pfl-coord status` say, with the likely cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class FlapWatch:
    """Thread-safe: the hello handler notes, the status publisher and the waiting loop read."""

    def __init__(
        self,
        threshold: int = 3,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.window_s = window_s
        self._clock = clock
        self._joins: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def note(self, device_id: str) -> bool:
        """A hello from `device_id`; True when it has just started flapping (logged once)."""
        now = self._clock()
        with self._lock:
            joins = self._joins.setdefault(device_id, deque(maxlen=self.threshold))
            was = self._is_flapping(joins, now)
            joins.append(now)
            started = not was and self._is_flapping(joins, now)
        if started:
            logger.warning(
                "device %s rejoined %d times within %.0f s: two devices probably run with this "
                "id (or its connection keeps dropping); see docs/troubleshooting.md",
                device_id,
                self.threshold,
                self.window_s,
            )
        return started

    def flapping(self) -> frozenset[str]:
        """The device ids that rejoined `threshold` times within the last `window_s`."""
        now = self._clock()
        with self._lock:
            return frozenset(d for d, joins in self._joins.items() if self._is_flapping(joins, now))

    def _is_flapping(self, joins: deque[float], now: float) -> bool:
        return len(joins) >= self.threshold and now - joins[0] <= self.window_s
