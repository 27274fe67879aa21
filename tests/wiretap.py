"""A real transport whose deliveries are logged: which topics reached a client, how many bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from protocols.codec import decode_frame
from protocols.messages import Message
from protocols.transport.base import MessageHandler, Transport, TransportWrapper

M = TypeVar("M", bound=Message)


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


def recorded_into(into: list[tuple[str, bytes]]) -> MessageHandler:
    """A handler that keeps each delivery's topic and payload in `into`."""

    def keep(topic: str, payload: bytes) -> None:
        into.append((topic, payload))

    return keep


def decoded_into(kind: type[M], into: list[M]) -> MessageHandler:
    """A handler that decodes each frame and keeps its message in `into` if it is a `kind`.

    Subscribed to a topic that carries one kind only, it keeps every message delivered there.
    """

    def keep(_topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if isinstance(message, kind):
            into.append(message)

    return keep


class Inbox:
    """A handler that collects (topic, payload) pairs from a transport's dispatch thread."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self.messages.append((topic, payload))

    def topics(self) -> list[str]:
        """The topics received so far."""
        with self._lock:
            return [topic for topic, _ in self.messages]

    def payloads(self) -> list[bytes]:
        """The payloads received so far."""
        with self._lock:
            return [payload for _, payload in self.messages]

    def has(self, count: int) -> Callable[[], bool]:
        """A condition: at least `count` messages have arrived."""
        return lambda: len(self.payloads()) >= count
