"""A real transport whose deliveries are logged: which topics reached a client, how many bytes."""

from __future__ import annotations

from collections.abc import Callable

from protocols.transport.base import MessageHandler, Transport, TransportStats


class Wiretap:
    """Wraps a connected transport; every message handed to a handler is logged first."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.client_id = inner.client_id
        self.log: list[tuple[str, int]] = []

    @property
    def stats(self) -> TransportStats:
        """The wrapped transport's counters."""
        return self.inner.stats

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish through the wrapped transport."""
        self.inner.publish(topic, payload, retain=retain)

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Subscribe through the wrapped transport, logging each delivery."""

        def logged(topic: str, payload: bytes) -> None:
            self.log.append((topic, len(payload)))
            handler(topic, payload)

        self.inner.subscribe(pattern, logged)

    def unsubscribe(self, pattern: str) -> None:
        """Unsubscribe through the wrapped transport."""
        self.inner.unsubscribe(pattern)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait through the wrapped transport."""
        return self.inner.wait_until(predicate, timeout_s)

    def close(self) -> None:
        """Close the wrapped transport."""
        self.inner.close()

    def topics_since(self, mark: int) -> list[str]:
        """The topics delivered after log entry `mark`."""
        return [topic for topic, _ in self.log[mark:]]
