"""The work a scheduler hands out: who was asked for which aggregation, and how it ended.

Shared by the buffered scheduler (`coordinator.scheduling.asynchronous`) and its synchronous
rounds on the simulated clock (`coordinator.scheduling.clock_cohort`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from coordinator.engine.intake import Collector
from coordinator.strategies.base import ReceivedUpdate


@dataclass(frozen=True)
class Dispatch:
    """Work a device was asked for."""

    round_id: int
    """The aggregation it was meant for: the model version it started from, plus one."""
    event_s: float = 0.0
    """Simulated: when the device finishes, or drops out."""
    survives: bool = True
    """Simulated: whether it stays online until it finishes."""
    deadline: float = math.inf
    """Real time (`time.monotonic()`): when the coordinator gives the work up."""


class DispatchInbox(Collector[ReceivedUpdate]):
    """Updates from devices asked at different times for different aggregations.

    Each device answers the work it was last asked for, once; the engine settles that work
    (takes the answer or gives it up) before asking the device again.
    """

    def __init__(self) -> None:
        super().__init__(0, "train", set())
        self.rounds: dict[str, int] = {}
        self._arrivals: list[str] = []
        self._news = threading.Event()

    def dispatch(self, device_id: str, round_id: int) -> None:
        """`device_id` was asked to train for aggregation `round_id`."""
        with self._lock:
            self.expected.add(device_id)
            self.rounds[device_id] = round_id
            self.answers.pop(device_id, None)
            self.declined.discard(device_id)

    def asks(self, device_id: str, round_id: int) -> bool:
        """Only the work a device was asked for and has not answered yet."""
        with self._lock:
            return self.rounds.get(device_id) == round_id and device_id not in self.answers

    def offer(self, device_id: str, answer: ReceivedUpdate) -> bool:
        """Take the first answer to a device's open work; note its arrival."""
        if not super().offer(device_id, answer):
            return False
        with self._lock:
            self._arrivals.append(device_id)
        return True

    def decline(self, device_id: str) -> None:
        """The device will not answer its open work (it said so, or it is quarantined)."""
        with self._lock:
            if device_id in self.expected and device_id not in self.answers:
                self.declined.add(device_id)
                self._arrivals.append(device_id)

    def landed(self, device_id: str) -> bool:
        """The device answered or declined its open work."""
        with self._lock:
            return device_id in self.answers or device_id in self.declined

    def has_arrivals(self) -> bool:
        """Whether an answer or decline arrived since `arrivals()` was last called."""
        with self._lock:
            return bool(self._arrivals)

    def arrivals(self) -> list[str]:
        """Devices whose answer or decline arrived since the last call, in arrival order."""
        with self._lock:
            arrived, self._arrivals = self._arrivals, []
            return arrived

    def requeue(self, device_ids: list[str]) -> None:
        """Arrivals taken but not settled (the buffer filled first): first in the next call."""
        with self._lock:
            self._arrivals[:0] = device_ids

    def settle(self, device_id: str) -> tuple[ReceivedUpdate | None, bool]:
        """Close a device's open work: (its answer or None, whether it declined)."""
        with self._lock:
            self.expected.discard(device_id)
            self.rounds.pop(device_id, None)
            declined = device_id in self.declined
            self.declined.discard(device_id)
            return self.answers.pop(device_id, None), declined


@dataclass
class Tally:
    """What happened to the work that ended during one aggregation."""

    asked: int = 0
    declined: int = 0
    lost: int = 0
    stale: int = 0
    late: int = 0
    over_share: int = 0
