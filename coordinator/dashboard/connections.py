"""Connection limits of the dashboard's server, so idle sockets cannot use up `serve`'s files.

uvicorn closes a connection only once a request was answered (keep-alive timeout); a socket that
never sends a whole request head stays open, and each holds a descriptor of the process that
also writes checkpoints and talks MQTT. Here every connection must send its request head within
`header_timeout_s`, and at most `max_connections` stay open: a new one beyond that closes the
longest-open connection with no request in progress (or itself when every one is busy), so a
flood of idle sockets cannot lock viewers out either.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    """How many connections the dashboard holds and how long a request head may take."""

    max_connections: int = 64
    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    """An answered connection's wait for its next request (uvicorn's keep-alive)."""
    backlog: int = 32
    """Connections the kernel queues, and the most the server accepts in one go."""
    max_header_bytes: int = 16 * 1024


def limited_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """The h11 protocol of uvicorn with `limits`' connection cap and request-head deadline."""

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.opened_at = 0.0
            self._head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.opened_at = self.loop.time()
            self._await_head()
            open_now = [
                c
                for c in self.connections
                if isinstance(c, H11Protocol) and not c.transport.is_closing()
            ]
            if len(open_now) > limits.max_connections:
                idle = [c for c in open_now if _between_requests(c)]
                victim = min(idle, key=lambda c: getattr(c, "opened_at", 0.0), default=self)
                victim.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_arrived()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if _between_requests(self):
                self._await_head()
            super().data_received(data)
            if not _between_requests(self):
                self._head_arrived()

        def _await_head(self) -> None:
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(limits.header_timeout_s, self._late)

        def _head_arrived(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _late(self) -> None:
            self._head_deadline = None
            if _between_requests(self):
                self.transport.close()

    return LimitedH11Protocol


def _between_requests(connection: H11Protocol) -> bool:
    """No request in progress: none arrived yet, or the last one was answered."""
    return connection.cycle is None or connection.cycle.response_complete
