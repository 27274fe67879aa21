"""The link between a simulation's hub and the worker processes that run its virtual devices.

The hub in the parent stays the one broker: every subscription lives there, so retained
messages, ordering per subscriber and byte counts are what one process would see. A worker's
devices publish and subscribe through `RemoteTransport`, which forwards each call up the pipe;
the hub sends each delivery down once per worker with the ids of the subscriptions it is for.

A frame is a kind byte, a JSON header and raw payload bytes: nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from protocols.errors import describe
from protocols.transport.base import MessageHandler, ReconnectHook, TransportStats

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<cI")

# worker -> hub
CONNECT = b"C"
PUBLISH = b"P"
SUBSCRIBE = b"U"
UNSUBSCRIBE = b"D"
CLOSE = b"X"
SYNCED = b"Y"
REPLY = b"R"
# hub -> worker
DELIVER = b"M"
SYNC = b"S"
REQUEST = b"Q"
STOP = b"Z"
# a delivery's "k": keep this retained payload for its topic / the payload is the one kept
KEEP = 1
KEPT = 2
KEEP_MIN_BYTES = 4096
"""Smaller retained payloads (statuses, announcements) are cheaper to send than to keep."""


@dataclass(frozen=True)
class Frame:
    """One frame on a link: its kind, its header fields and its payload."""

    kind: bytes
    header: dict[str, Any]
    payload: bytes = b""


def encode_link_frame(frame: Frame) -> bytes:
    """The bytes of `frame`."""
    header = json.dumps(frame.header, separators=(",", ":")).encode()
    return _HEADER.pack(frame.kind, len(header)) + header + frame.payload


def decode_link_frame(data: bytes) -> Frame:
    """The frame in `data`.

    Raises:
        ValueError: too short, or a header that is not a JSON object.
    """
    if len(data) < _HEADER.size:
        msg = f"link frame of {len(data)} bytes is shorter than its {_HEADER.size}-byte header"
        raise ValueError(msg)
    kind, size = _HEADER.unpack_from(data)
    end = _HEADER.size + size
    try:
        header = json.loads(data[_HEADER.size : end]) if end <= len(data) else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        msg = f"link frame {kind!r}: its header is not a JSON object within the frame"
        raise ValueError(msg)
    return Frame(kind, header, data[end:])


class WorkerEnd:
    """A worker's side of the link: sends its devices' calls up, hands deliveries to them."""

    def __init__(self, up: Connection) -> None:
        self._up = up
        self._handlers: dict[int, tuple[RemoteTransport, MessageHandler]] = {}
        self._next_subscription = 0
        self._kept: dict[str, bytes] = {}
        self.transports: list[RemoteTransport] = []

    def connect(self, client_id: str) -> RemoteTransport:
        """A transport for a device of this worker."""
        transport = RemoteTransport(self, len(self.transports), client_id)
        self.transports.append(transport)
        self.send(Frame(CONNECT, {"d": transport.slot, "id": client_id}))
        return transport

    def send(self, frame: Frame) -> None:
        """Send `frame` up (blocks while the hub is busy: the pipe is the backpressure)."""
        self._up.send_bytes(encode_link_frame(frame))

    def register(self, transport: RemoteTransport, handler: MessageHandler) -> int:
        """A new subscription id for `handler`."""
        self._next_subscription += 1
        self._handlers[self._next_subscription] = (transport, handler)
        return self._next_subscription

    def drop(self, subscriptions: list[int]) -> None:
        """Stop handing messages to `subscriptions` (deliveries already on the way are skipped)."""
        for subscription in subscriptions:
            self._handlers.pop(subscription, None)

    def deliver(self, frame: Frame) -> None:
        """Hand one delivery to each subscription it names, in order, as the hub would."""
        topic: str = frame.header["t"]
        payload = frame.payload
        keep = frame.header.get("k")
        if keep == KEEP:
            self._kept[topic] = payload
        elif keep == KEPT:
            payload = self._kept[topic]
        for subscription in frame.header["s"]:
            entry = self._handlers.get(subscription)
            if entry is None:  # unsubscribed since the hub sent it
                continue
            transport, handler = entry
            transport.stats.bytes_received += len(payload)
            transport.stats.messages_received += 1
            try:
                handler(topic, payload)
            except Exception as error:  # a handler never stops the worker, as with the hub
                logger.debug("handler of %s failed", transport.client_id, exc_info=True)
                logger.warning(
                    "%s dropped a message on %s: %s", transport.client_id, topic, describe(error)
                )

    def traffic(self) -> tuple[int, int]:
        """Payload bytes this worker's devices sent and received."""
        sent = sum(t.stats.bytes_sent for t in self.transports)
        return sent, sum(t.stats.bytes_received for t in self.transports)


class RemoteTransport:
    """A virtual device's transport in a worker process: every call goes to the parent's hub."""

    def __init__(self, end: WorkerEnd, slot: int, client_id: str) -> None:
        self.client_id = client_id
        self.slot = slot
        self.stats = TransportStats()
        self.displaced: str | None = None
        """Always None: the parent's hub lets no client take another's id."""
        self._end = end
        self._subscriptions: dict[str, list[int]] = {}

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish through the hub."""
        self.stats.bytes_sent += len(payload)
        self.stats.messages_sent += 1
        self._end.send(Frame(PUBLISH, {"d": self.slot, "t": topic, "r": retain}, payload))

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Subscribe at the hub; retained messages arrive as they would there."""
        subscription = self._end.register(self, handler)
        self._subscriptions.setdefault(pattern, []).append(subscription)
        self._end.send(Frame(SUBSCRIBE, {"d": self.slot, "s": subscription, "p": pattern}))

    def unsubscribe(self, pattern: str) -> None:
        """Stop receiving `pattern` at once; the hub forgets it when the frame arrives."""
        self._end.drop(self._subscriptions.pop(pattern, []))
        self._end.send(Frame(UNSUBSCRIBE, {"d": self.slot, "p": pattern}))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Handlers run one at a time on the worker's loop: nothing arrives while one waits."""
        del timeout_s
        return predicate()

    def on_reconnect(self, hook: ReconnectHook | None) -> None:
        """Nothing to do: a pipe to the parent's hub is never lost and regained."""
        del hook

    def close(self) -> None:
        """Leave without a will."""
        self._end.send(Frame(CLOSE, {"d": self.slot}))
