"""Devices over their limits sit out the rest of the round.

A device whose messages keep being dropped (a flood over its rate, malformed frames, lies about
its counts) costs the coordinator work for each one. Once its drops in the current round pass
the limit, or once a protocol proves it lied (secure aggregation's dealer of false shares),
everything it sends is ignored until the next round starts, and the round stops waiting for it;
`pfl-coord status` shows it as quarantined.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

logger = logging.getLogger(__name__)


class Quarantine:
    """Thread-safe: handlers check senders, the engine starts rounds and reads who is held."""

    def __init__(self, limit: int) -> None:
        """`limit`: dropped messages a device may have in one round (0: never quarantine)."""
        self.limit = limit
        self._baseline: dict[str, int] = {}
        self._held: set[str] = set()
        self._round_id = 0
        self._lock = threading.Lock()

    def start_round(self, round_id: int, dropped: Mapping[str, int]) -> None:
        """Release every device; count drops from the totals in `dropped` onwards."""
        with self._lock:
            released = sorted(self._held)
            self._baseline, self._held, self._round_id = dict(dropped), set(), round_id
        if released:
            logger.info("released from quarantine: %s", ", ".join(released))

    def holds(self, sender: str, dropped: int) -> tuple[bool, bool]:
        """Whether `sender`, with `dropped` drops in total, is quarantined; and whether newly."""
        with self._lock:
            if sender in self._held:
                return True, False
            if self.limit <= 0 or dropped - self._baseline.get(sender, 0) <= self.limit:
                return False, False
            self._held.add(sender)
            round_id = self._round_id
        logger.warning(
            "device %s quarantined for the rest of round %d: more than %d messages dropped",
            sender,
            round_id,
            self.limit,
        )
        return True, True

    def hold(self, sender: str, reason: str) -> None:
        """Quarantine `sender` for the rest of the round whatever its count: a proven lie."""
        with self._lock:
            newly = sender not in self._held
            self._held.add(sender)
            round_id = self._round_id
        if newly:
            logger.warning(
                "device %s quarantined for the rest of round %d: %s", sender, round_id, reason
            )

    def held(self) -> frozenset[str]:
        """The devices quarantined now."""
        with self._lock:
            return frozenset(self._held)
