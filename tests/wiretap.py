"""A real transport whose deliveries are logged: which topics reached a client, how many bytes."""

from __future__ import annotations

from protocols.transport.base import MessageHandler, Transport, TransportWrapper


class Wiretap(TransportWrapper):
    """Wraps a connected transport; every message handed to a handler is logged first."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.log: list[tuple[str, int]] = []

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Subscribe through the wrapped transport, logging each delivery."""

        def logged(topic: str, payload: bytes) -> None:
            self.log.append((topic, len(payload)))
            handler(topic, payload)

        self.inner.subscribe(pattern, logged)

    def topics_since(self, mark: int) -> list[str]:
        """The topics delivered after log entry `mark`."""
        return [topic for topic, _ in self.log[mark:]]
