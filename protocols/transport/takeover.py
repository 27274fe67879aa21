"""Noticing that another client holds our client id, and giving up instead of fighting it.

Two clients with one client id knock each other off the broker forever: each reconnect takes the
session from the other. MQTT 5 says so (reason "Session taken over"); under MQTT 3.1.1 the
broker just closes the older connection, so a connection that keeps ending within seconds of
being made is the same sign. After `max_takeovers` in a row the transport stops reconnecting
and says why; one of the two clients then keeps the id.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SESSION_TAKEN_OVER = 142
"""The MQTT 5 DISCONNECT reason a broker gives the older of two connections with one id."""


class TakeoverWatch:
    """Counts connections lost to a client with the same id; says when to stop reconnecting.

    Under MQTT 3.1.1 a loss counts when the connection had lasted less than `short_lived_s`
    and the very next attempt found the broker up with our session still there: what a
    takeover looks like, and what a broker restart (a failed attempt, or a lost session) or a
    long-lived connection does not. The last loss gives up before reconnecting, so the other
    client is not knocked off once more and keeps the id.
    """

    def __init__(
        self,
        client_id: str,
        max_takeovers: int,
        short_lived_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_takeovers` 0 never gives up."""
        self.client_id = client_id
        self.max_takeovers = max_takeovers
        self.short_lived_s = short_lived_s
        self.count = 0
        self._clock = clock
        self._connected_at: float | None = None
        self._suspect = False

    def connected(self, session_present: bool) -> None:
        """A connection was established: a suspect loss before it is confirmed or cleared."""
        suspect, self._suspect = self._suspect, False
        self._connected_at = self._clock()
        if suspect and session_present:
            self.count += 1
        elif suspect:
            self.count = 0

    def disconnected(self, reason_code: int | None) -> str | None:
        """A connection was lost; the reason to give up (MQTT 5 says so), or None."""
        lasted = None if self._connected_at is None else self._clock() - self._connected_at
        self._connected_at = None
        if reason_code == SESSION_TAKEN_OVER:
            return self._counted(
                "the broker handed its session to another connection with the same client id"
            )
        self._suspect = lasted is not None and lasted < self.short_lived_s
        if not self._suspect:
            self.count = 0
            return None
        if self.max_takeovers > 0 and self.count + 1 >= self.max_takeovers:
            return self._counted("its connection was closed within seconds of connecting")
        return None

    def connect_failed(self) -> None:
        """An attempt failed: the broker was away, nobody took the session."""
        self._suspect = False
        self.count = 0

    def _counted(self, cause: str) -> str | None:
        self.count += 1
        if self.max_takeovers <= 0 or self.count < self.max_takeovers:
            return None
        return (
            f"{self.client_id}: {cause}, {self.count} times in a row; another device (or "
            f"program) probably runs with the same id, e.g. a copied --device-id {self.client_id}"
            ". Stopped reconnecting: give each device its own id"
        )
