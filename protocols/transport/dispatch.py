"""The receiving half of the MQTT transport: one thread that reassembles and dispatches.

paho's network loop only enqueues; handlers run here, one message at a time, so a slow handler
never stalls keep-alives and an exception in one never stops the transport.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocols.errors import ProtocolError, describe
from protocols.offences import Offences
from protocols.topics import parse_chunk_topic, topic_matches
from protocols.transport import chunking
from protocols.transport.base import MessageHandler, TransportStats
from protocols.transport.inbound import FLEET_CHANNEL, FairInbox, sender_of
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)

_UNCLAIMED_MESSAGES = 256


@dataclass
class MqttTransportStats(TransportStats):
    """Payload counters plus what actually crossed the wire (chunk headers, retained clears)."""

    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0


@dataclass(frozen=True)
class Reconnected:
    """Run the transport's reconnect hook on the dispatch thread, in order with messages."""

    hook: Callable[[], None]


@dataclass(frozen=True)
class Replay:
    """Hand messages that arrived before any handler matched them to a new subscription."""

    pattern: str
    handler: MessageHandler


_Item = tuple[str, bytes] | Replay | Reconnected | None


class Dispatcher:
    """The receiving half: one thread that reassembles chunks and calls matching handlers.

    Messages that match no handler yet (a persistent session delivers its queue right after
    CONNACK, before a restarted program has subscribed again) are kept, bounded, and handed to
    the first subscription that matches them.
    """

    def __init__(
        self,
        client_id: str,
        settings: BrokerSettings,
        stats: MqttTransportStats,
        offences: Offences | None = None,
    ) -> None:
        self.client_id = client_id
        self.stats = stats
        self.offences = offences or Offences()
        self.handlers: list[tuple[str, MessageHandler]] = []
        self.lock = threading.Lock()
        self._max_bytes = settings.max_payload_bytes
        self._reassembler = chunking.Reassembler(
            settings.max_payload_bytes,
            settings.reassembly_timeout_s,
            max_transfers_per_sender=settings.max_transfers_per_sender,
            sender_of=sender_of,
            on_drop=self.offences.record,
        )
        self._inbox: FairInbox[_Item] = FairInbox(
            per_sender=settings.max_queued_per_sender,
            rate=settings.max_messages_per_s,
            burst=settings.max_burst_messages,
        )
        self._unclaimed: deque[tuple[str, bytes]] = deque()
        self._delivered = threading.Condition()
        self.thread = threading.Thread(
            target=self._run, name=f"mqtt-dispatch-{client_id}", daemon=True
        )

    def put(self, item: _Item) -> None:
        """Queue a message (charged to its sender), a replay request, or None to stop."""
        if isinstance(item, tuple):
            sender = sender_of(item[0])
            dropped = self._inbox.put(sender, item)
            if dropped:
                self.offences.record(sender, item[0], dropped)
        else:
            self._inbox.put(FLEET_CHANNEL, item)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Re-check `predicate` after each message and every 0.1 s until it holds or time is up."""
        if threading.current_thread() is self.thread:
            return predicate()  # a handler cannot wait for messages its own thread delivers
        deadline = time.monotonic() + timeout_s
        with self._delivered:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return predicate()
                self._delivered.wait(min(0.1, remaining))
        return True

    def stop(self, timeout_s: float) -> None:
        """Deliver what is queued, then end the thread."""
        self.put(None)
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            got, item = self._inbox.get(0.5)
            if not got:
                self._reassembler.expire()
                continue
            if item is None:
                return
            try:
                if isinstance(item, Replay):
                    self._replay(item)
                elif isinstance(item, Reconnected):
                    item.hook()
                else:
                    self._deliver(*item)
            except Exception:  # one bad message must never stop the transport
                logger.exception("%s dropped a message: %.200r", self.client_id, item)
            with self._delivered:
                self._delivered.notify_all()

    def _deliver(self, topic: str, payload: bytes) -> None:
        self.stats.wire_bytes_received += len(payload)
        chunk = parse_chunk_topic(topic)
        if chunk is not None:
            if not payload:
                return  # a publisher clearing a stale retained chunk
            try:
                whole = self._reassembler.add(chunk[0], payload)
            except ProtocolError as error:
                self.offences.record(sender_of(topic), topic, f"bad chunk: {error}")
                return
            self._reassembler.expire_due()
            if whole is None:
                return
            topic, payload = chunk[0], whole
        self.stats.bytes_received += len(payload)
        self.stats.messages_received += 1
        with self.lock:
            matching = [(p, h) for p, h in self.handlers if topic_matches(p, topic)]
        if not matching:
            self._unclaimed.append((topic, payload))
            held = sum(len(p) for _, p in self._unclaimed)
            while len(self._unclaimed) > _UNCLAIMED_MESSAGES or held > self._max_bytes:
                held -= len(self._unclaimed.popleft()[1])
        for pattern, handler in matching:
            self._call(pattern, handler, topic, payload)

    def _replay(self, replay: Replay) -> None:
        claimed = [(t, p) for t, p in self._unclaimed if topic_matches(replay.pattern, t)]
        self._unclaimed = deque(m for m in self._unclaimed if m not in claimed)
        for topic, payload in claimed:
            self._call(replay.pattern, replay.handler, topic, payload)

    def _call(self, pattern: str, handler: MessageHandler, topic: str, payload: bytes) -> None:
        try:
            handler(topic, payload)
        except Exception as error:  # one line per sender and interval; the traceback in debug
            logger.debug(
                "%s: handler for %s failed on %s", self.client_id, pattern, topic, exc_info=True
            )
            self.offences.record(sender_of(topic), topic, describe(error))
