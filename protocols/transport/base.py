"""The transport interface the coordinator and the agents are written against.

Both sides publish bytes to topics and react to bytes on subscribed topics. A transport never
parses payloads; it moves them, counts them, and calls handlers one message at a time on a single
thread of its own choosing (never inside a network loop), so handlers may take time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

MessageHandler = Callable[[str, bytes], None]
ReconnectHook = Callable[[], None]


@dataclass
class TransportStats:
    """Bytes and messages a client moved, payload bytes only (topic and framing excluded)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


@dataclass(frozen=True)
class Will:
    """A message the broker publishes on the client's behalf if it vanishes without closing."""

    topic: str
    payload: bytes
    retain: bool = True


class Transport(Protocol):
    """A connected client of a publish/subscribe broker."""

    client_id: str

    @property
    def stats(self) -> TransportStats:
        """Bytes and messages this end has moved (a transport may count more)."""
        ...

    @property
    def displaced(self) -> str | None:
        """Why it stopped for good: another client keeps taking its id (None while not)."""
        ...

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Send `payload` to `topic` at QoS 1; `retain` keeps it for late subscribers."""
        ...

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Call `handler(topic, payload)` for every message matching the MQTT `pattern`."""
        ...

    def unsubscribe(self, pattern: str) -> None:
        """Stop receiving `pattern`: its handlers are dropped and the broker stops sending.

        Harmless for a pattern not subscribed (it also clears one a kept session still holds).
        """
        ...

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Let messages flow until `predicate()` holds or `timeout_s` passes; return predicate().

        Handlers run during the wait (in-process) or on the transport's dispatch thread (MQTT),
        and `predicate` must be cheap and thread-safe.
        """
        ...

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        """Call `hook` (as handlers are called) whenever a lost connection is back.

        A restarted broker has forgotten retained liveness and who said hello, so a client
        says it again here. Replaces an earlier hook; None removes it. Transports that cannot
        lose their connection (in-process) never call it.
        """
        ...

    def close(self) -> None:
        """Disconnect cleanly: the broker does not publish the will."""
        ...


@runtime_checkable
class ExpiringPublisher(Protocol):
    """A transport whose broker can drop a message once it is useless (MQTT 5 message expiry)."""

    def publish_expiring(
        self, topic: str, payload: bytes, *, retain: bool = False, expiry_s: int
    ) -> None:
        """`publish`, but the broker forgets the message after `expiry_s` seconds."""
        ...


def publish_expiring(
    transport: Transport,
    topic: str,
    payload: bytes,
    *,
    retain: bool = False,
    expiry_s: int | None,
) -> None:
    """Publish a message useless after `expiry_s` seconds (e.g. the call for a round that closed).

    Where the transport supports it, the broker drops the message then, from the queue it keeps
    for a device that is away and as the retained message; elsewhere, or with `expiry_s` None,
    it is a plain `publish`.
    """
    if expiry_s is not None and isinstance(transport, ExpiringPublisher):
        transport.publish_expiring(topic, payload, retain=retain, expiry_s=expiry_s)
    else:
        transport.publish(topic, payload, retain=retain)


class TransportWrapper:
    """A transport that forwards every call to `inner`: subclasses change what they need.

    A subclass that changes `publish` changes `publish_expiring` alike (it forwards to `inner`).
    """

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.client_id = inner.client_id

    @property
    def stats(self) -> TransportStats:
        """The inner transport's counters."""
        return self.inner.stats

    @property
    def displaced(self) -> str | None:
        """Whether the inner transport was displaced, and why."""
        return self.inner.displaced

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish through the inner transport."""
        self.inner.publish(topic, payload, retain=retain)

    def publish_expiring(
        self, topic: str, payload: bytes, *, retain: bool = False, expiry_s: int
    ) -> None:
        """Publish an expiring message through the inner transport (plainly, if it cannot)."""
        publish_expiring(self.inner, topic, payload, retain=retain, expiry_s=expiry_s)

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Subscribe through the inner transport."""
        self.inner.subscribe(pattern, handler)

    def unsubscribe(self, pattern: str) -> None:
        """Unsubscribe through the inner transport."""
        self.inner.unsubscribe(pattern)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait through the inner transport."""
        return self.inner.wait_until(predicate, timeout_s)

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        """Hear of reconnects through the inner transport."""
        self.inner.on_reconnect(hook)

    def close(self) -> None:
        """Close the inner transport."""
        self.inner.close()
