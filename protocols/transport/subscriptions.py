"""The filters a transport subscribed to, and which of them a broker's kept session holds.

After a reconnect the transport subscribes again only where needed: everything when the broker
lost the session (a restart, an expiry), and otherwise only the filters the broker never
acknowledged. Subscribing again to a filter a kept session holds would make an MQTT 3.1.1
broker send every retained message on it again: a model download cut halfway would start over
instead of resuming from the session's queue.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Final

from paho.mqtt.reasoncodes import ReasonCode

_REMEMBERED_SUBSCRIBES: Final = 256
"""Re-subscriptions awaiting their SUBACK; older ones were lost with a connection."""


class SessionFilters:
    """Subscribed filters in order, those not yet acknowledged, and re-subscriptions in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._filters: list[str] = []
        self._unconfirmed: set[str] = set()
        self._resubscribing: dict[int, list[str]] = {}

    def add(self, filters: Iterable[str]) -> list[str]:
        """Take `filters`; return those not held yet (to subscribe, unconfirmed until acked)."""
        with self._lock:
            new = [f for f in filters if f not in self._filters]
            self._filters.extend(new)
            self._unconfirmed.update(new)
            return new

    def remove(self, filters: Iterable[str]) -> None:
        """Forget `filters` (unsubscribed, or refused by the broker)."""
        gone = set(filters)
        with self._lock:
            self._filters = [f for f in self._filters if f not in gone]
            self._unconfirmed -= gone

    def confirmed(self, filters: Iterable[str]) -> None:
        """The broker acknowledged `filters`: a session it keeps holds them."""
        with self._lock:
            self._unconfirmed.difference_update(filters)

    def to_resubscribe(self, session_present: bool) -> list[str]:
        """What to subscribe to again after a (re)connect."""
        with self._lock:
            if not session_present:
                return list(self._filters)
            return [f for f in self._filters if f in self._unconfirmed]

    def resubscribing(self, mid: int, filters: list[str]) -> None:
        """A re-subscription of `filters` went out as message `mid`."""
        with self._lock:
            self._resubscribing[mid] = filters
            while len(self._resubscribing) > _REMEMBERED_SUBSCRIBES:
                del self._resubscribing[next(iter(self._resubscribing))]

    def acknowledged(self, mid: int, codes: Sequence[ReasonCode]) -> bool:
        """A SUBACK arrived; True if it answers a re-subscription (nobody else waits for it)."""
        with self._lock:
            filters = self._resubscribing.pop(mid, None)
        if filters is None:
            return False
        self.confirmed(f for f, code in zip(filters, codes, strict=False) if not code.is_failure)
        return True
