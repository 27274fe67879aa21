"""An in-process broker for simulation: the same messages, encoded the same way, no sockets.

Messages are queued and delivered in publish order when some client waits, so a run on one thread
is deterministic. Retained messages and last-wills behave as on an MQTT broker.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocols.errors import describe
from protocols.topics import topic_matches
from protocols.transport.base import MessageHandler, ReconnectHook, TransportStats, Will

logger = logging.getLogger(__name__)
_MATCHED_TOPICS = 1 << 16
"""Topics whose wildcard matches are remembered: each device's recur every round."""
_named: weakref.WeakValueDictionary[str, InProcessBroker] = weakref.WeakValueDictionary()
"""Hubs reachable as inproc://<name>, for as long as something else holds them."""
_naming = threading.Lock()


@dataclass(eq=False)
class _Subscription:
    pattern: str
    handler: MessageHandler
    client: InProcessTransport
    active: bool = True


@dataclass(frozen=True)
class _Delivery:
    topic: str
    payload: bytes
    only: _Subscription | None = None  # a retained message for one new subscriber


@dataclass
class InProcessBroker:
    """The hub every in-process client connects to.

    A hub given a `name` is also reachable as `inproc://<name>` (see `named_hub`) while it lives;
    one without is reached through the object only.
    """

    _exact: dict[str, dict[int, _Subscription]] = field(default_factory=dict)
    _wildcards: list[_Subscription] = field(default_factory=list)
    _retained: dict[str, bytes] = field(default_factory=dict)
    _matching: dict[str, list[_Subscription]] = field(default_factory=dict)
    """The wildcard subscriptions each topic matched, until the wildcards change."""
    _queue: deque[_Delivery] = field(default_factory=deque)
    _dispatching: bool = False
    delivered: Counter[str] = field(default_factory=Counter)
    """Payload bytes delivered per topic, summed over recipients (what a broker sends out)."""
    name: str | None = field(default=None, kw_only=True)
    """Letters, digits, `.`, `_` and `-`: what `inproc://<name>` can say (None: no URL)."""
    idle: list[Callable[[], None]] = field(default_factory=list, kw_only=True)
    """Called when the queue runs dry while someone waits (e.g. work kept to run batched);
    what they publish is delivered before the wait ends."""

    def __post_init__(self) -> None:
        if self.name is None:
            return
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            msg = f"in-process hub name {self.name!r}: use letters, digits, '.', '_' and '-'"
            raise ValueError(msg)
        with _naming:
            if self.name in _named:
                msg = f"an in-process hub named {self.name!r} already exists: pick another name"
                raise ValueError(msg)
            _named[self.name] = self

    def connect(self, client_id: str, will: Will | None = None) -> InProcessTransport:
        """A new client of this hub."""
        return InProcessTransport(self, client_id, will)

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if retain:
            if payload:
                self._retained[topic] = payload
            else:
                self._retained.pop(topic, None)
        self._queue.append(_Delivery(topic, payload))

    def _subscribe(self, subscription: _Subscription) -> None:
        pattern = subscription.pattern
        if "+" in pattern or "#" in pattern:
            self._wildcards.append(subscription)
            self._matching.clear()
            retained = [(t, p) for t, p in self._retained.items() if topic_matches(pattern, t)]
        else:  # by lookup: 10,000 devices each retain a status
            self._exact.setdefault(pattern, {})[id(subscription)] = subscription
            payload = self._retained.get(pattern)
            retained = [] if payload is None else [(pattern, payload)]
        for topic, payload in retained:
            self._queue.append(_Delivery(topic, payload, subscription))

    def _unsubscribe(self, subscriptions: list[_Subscription]) -> None:
        for subscription in subscriptions:
            subscription.active = False  # retained copies queued for it are not delivered
            if subscription in self._wildcards:
                self._wildcards.remove(subscription)
                self._matching.clear()
            else:
                self._exact.get(subscription.pattern, {}).pop(id(subscription), None)

    def _drop(self, client: InProcessTransport) -> None:
        for subscriptions in client._subscriptions.values():
            self._unsubscribe(subscriptions)
        client._subscriptions.clear()

    def pump(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Deliver queued messages until `predicate()` holds or nothing is left to deliver.

        Time does not pass in-process, so `timeout_s` does not matter here (a hub fed by other
        processes waits for them up to it).
        """
        del timeout_s
        if self._dispatching:  # a handler waiting inside a handler: let the outer loop deliver
            return predicate()
        self._dispatching = True
        try:
            while not predicate() and (self._queue or self._run_idle()):
                self._deliver(self._queue.popleft())
        finally:
            self._dispatching = False
        return predicate()

    def _run_idle(self) -> bool:
        """Call the idle hooks; whether they queued something to deliver."""
        for hook in self.idle:
            hook()
        return bool(self._queue)

    def _deliver(self, delivery: _Delivery) -> None:
        for subscription in self._targets(delivery):
            if subscription.active:  # not dropped by a handler earlier in this delivery
                self._hand(subscription, delivery.topic, delivery.payload)

    def _targets(self, delivery: _Delivery) -> list[_Subscription]:
        if delivery.only is not None:
            return [delivery.only]
        # exact subscriptions by lookup: a fleet of 1000 has 4000 of them
        matching = self._matching.get(delivery.topic)
        if matching is None:
            if len(self._matching) >= _MATCHED_TOPICS:
                self._matching.clear()
            matching = [s for s in self._wildcards if topic_matches(s.pattern, delivery.topic)]
            self._matching[delivery.topic] = matching
        return [*matching, *self._exact.get(delivery.topic, {}).values()]

    def _hand(self, subscription: _Subscription, topic: str, payload: bytes) -> None:
        stats = subscription.client.stats
        stats.bytes_received += len(payload)
        stats.messages_received += 1
        self.delivered[topic] += len(payload)
        try:
            subscription.handler(topic, payload)
        except Exception as error:  # a handler must never stop the hub, as with paho's loop
            logger.debug("handler of %s failed", subscription.client.client_id, exc_info=True)
            logger.warning(
                "%s dropped a message on %s: %s",
                subscription.client.client_id,
                topic,
                describe(error),
            )


def named_hub(name: str) -> InProcessBroker:
    """The live hub created with `name`.

    Raises:
        ValueError: no hub of that name is alive in this process.
    """
    with _naming:
        hub = _named.get(name)
        known = sorted(_named)
    if hub is None:
        listing = ", ".join(known) if known else "none"
        msg = f"no in-process hub named {name!r} in this process (named hubs: {listing})"
        raise ValueError(msg)
    return hub


class InProcessTransport:
    """One client of an `InProcessBroker`."""

    def __init__(self, broker: InProcessBroker, client_id: str, will: Will | None) -> None:
        self.client_id = client_id
        self.stats = TransportStats()
        self.displaced: str | None = None
        """Always None: the hub lets no client take another's id."""
        self._broker = broker
        self._will = will
        self._subscriptions: dict[str, list[_Subscription]] = {}

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Queue `payload` for every matching subscriber."""
        self.stats.bytes_sent += len(payload)
        self.stats.messages_sent += 1
        self._broker._publish(topic, payload, retain)

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Receive matching messages, retained ones first."""
        subscription = _Subscription(pattern, handler, self)
        self._subscriptions.setdefault(pattern, []).append(subscription)
        self._broker._subscribe(subscription)

    def unsubscribe(self, pattern: str) -> None:
        """Stop receiving `pattern`."""
        self._broker._unsubscribe(self._subscriptions.pop(pattern, []))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Deliver messages until `predicate()` holds (`timeout_s`: for other processes)."""
        return self._broker.pump(predicate, timeout_s)

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        """Nothing to do: an in-process client never loses its connection."""
        del hook

    def close(self) -> None:
        """Leave without a will."""
        self._broker._drop(self)

    def vanish(self) -> None:
        """Leave abruptly: the hub publishes the will, as a broker does on a lost connection."""
        self._broker._drop(self)
        if self._will is not None:
            self._broker._publish(self._will.topic, self._will.payload, self._will.retain)
