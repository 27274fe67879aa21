"""Device ids that keep rejoining: most often two devices running under one id.

Each of two agents with one id takes the broker session from the other and says hello again,
every second or two, so neither ever stays. The coordinator cannot tell them apart, but it sees
the hellos: one id rejoining `threshold` times within `window_s` is flapping, which the log and
`pfl-coord status` say, with the likely cause. A broker that does not knock the older connection
off shows no flapping, but then the hello of a second running instance (its own random token)
arrives while the first is online: a clash, which counts as flapping at once.

One reconnect brings a burst of hellos from one running instance (its own reconnect hook, the
answer to the coordinator's hello command after a broker restart, the answer to its will):
hellos of one instance within `burst_s` of its last counted one are the same rejoin.
"""

from __future__ import annotations

import logging
import math
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
        burst_s: float = 5.0,
    ) -> None:
        self.threshold = threshold
        self.window_s = window_s
        self.burst_s = burst_s
        self._clock = clock
        self._joins: dict[str, deque[float]] = {}
        self._last: dict[str, tuple[str, float]] = {}  # per id: the last counted instance, when
        self._clashes: dict[str, float] = {}
        self._suspects: set[str] = set()  # ids that may be flapping: a clash or enough joins
        self._lock = threading.Lock()

    def note(self, device_id: str, clash: bool = False, instance: str = "") -> bool:
        """A hello from `device_id`'s running `instance` (`clash`: a second one is online).

        True when it has just started flapping (logged once).
        """
        now = self._clock()
        with self._lock:
            last_instance, last_at = self._last.get(device_id, ("", -math.inf))
            if instance and instance == last_instance and now - last_at < self.burst_s:
                return False  # the same reconnect saying hello once more
            self._last[device_id] = (instance, now)
            was = self._is_flapping(device_id, now)
            joins = self._joins.setdefault(device_id, deque(maxlen=self.threshold))
            joins.append(now)
            if clash:
                self._clashes[device_id] = now
            if clash or len(joins) >= self.threshold:
                self._suspects.add(device_id)
            started = not was and self._is_flapping(device_id, now)
        if started:
            logger.warning(
                "device %s %s: two devices probably run with this id (or its connection keeps "
                "dropping); see docs/troubleshooting.md",
                device_id,
                "joined from a second running instance"
                if clash
                else f"rejoined {self.threshold} times within {self.window_s:.0f} s",
            )
        return started

    def flapping(self) -> frozenset[str]:
        """The device ids that rejoined `threshold` times within the last `window_s`."""
        now = self._clock()
        with self._lock:  # the suspects only, not every id that ever joined: read each round
            flapping = frozenset(d for d in self._suspects if self._is_flapping(d, now))
            self._suspects &= flapping  # a suspect again at its next join
            return flapping

    def _is_flapping(self, device_id: str, now: float) -> bool:
        if now - self._clashes.get(device_id, -math.inf) <= self.window_s:
            return True
        joins = self._joins.get(device_id)
        if joins is None or len(joins) < self.threshold:
            return False
        return now - joins[0] <= self.window_s
