"""Bounded, fair intake of inbound messages: one flooding sender cannot starve the others.

Every inbound message is charged to its sender (the device id of a device topic; "" for the
fleet's own channels, which only the coordinator may publish). A sender over its message rate
has the excess dropped before it is queued; each sender has its own bounded queue, and when it
is full the sender's own oldest message is dropped, never another sender's. The dispatch thread
takes senders in turn, so honest devices keep being served during a flood.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

from protocols.errors import ProtocolError
from protocols.topics import DEVICE_TOPIC_KINDS, parse_chunk_topic, parse_topic

Item = TypeVar("Item")
FLEET_CHANNEL = ""
"""The sender of messages on the fleet's own topics (model, round, command, relay)."""
UNKNOWN_SENDER = "?"
"""Charged with messages on topics that name no valid device (never quarantined: no one)."""


def sender_of(topic: str) -> str:
    """Who a message on `topic` is charged to: a device id, or the fleet channel."""
    chunk = parse_chunk_topic(topic)
    try:
        ref = parse_topic(chunk[0] if chunk else topic)
    except ProtocolError:
        return UNKNOWN_SENDER
    # command/<id> and relay/<id> name their recipient: they come from the coordinator
    sent_by_device = ref.device_id is not None and ref.kind in DEVICE_TOPIC_KINDS
    return ref.device_id if sent_by_device and ref.device_id else FLEET_CHANNEL


class TokenBucket:
    """`rate` messages per second on average, with bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class FairInbox(Generic[Item]):
    """Per-sender FIFO queues served round-robin, each bounded, each sender rate-limited.

    Thread-safe: the network thread puts, the dispatch thread gets.
    """

    def __init__(
        self,
        *,
        per_sender: int,
        rate: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_sender = per_sender
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._queues: OrderedDict[str, deque[Item]] = OrderedDict()
        self._buckets: dict[str, TokenBucket] = {}
        self._ready = threading.Condition()

    def put(self, sender: str, item: Item) -> str:
        """Queue `item`; returns why something of this sender was dropped ("" if nothing was).

        The fleet channel is neither rate-limited nor trimmed: it carries the coordinator's
        own messages and the transport's control items.
        """
        with self._ready:
            if sender != FLEET_CHANNEL:
                now = self._clock()
                bucket = self._buckets.get(sender)
                if bucket is None:
                    bucket = self._buckets[sender] = TokenBucket(self.rate, self.burst, now)
                if not bucket.take(now):
                    return f"over {self.rate:g} messages/s"
            queue = self._queues.get(sender)
            if queue is None:
                queue = self._queues[sender] = deque()
            queue.append(item)
            dropped = ""
            if sender != FLEET_CHANNEL and len(queue) > self.per_sender:
                queue.popleft()
                dropped = f"over {self.per_sender} queued messages (its oldest dropped)"
            self._ready.notify()
            return dropped

    def get(self, timeout_s: float) -> tuple[bool, Item | None]:
        """(True, the next item), taking senders in turn; (False, None) after `timeout_s`."""
        deadline = self._clock() + timeout_s
        with self._ready:
            while not self._queues:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False, None
                self._ready.wait(remaining)
            sender, queue = next(iter(self._queues.items()))
            item = queue.popleft()
            if queue:
                self._queues.move_to_end(sender)
            else:
                del self._queues[sender]
            return True, item

    def queued(self) -> int:
        """Items waiting, over every sender."""
        with self._ready:
            return sum(len(queue) for queue in self._queues.values())
