"""Splitting large payloads into broker-sized chunks and putting them back together, verified.

A payload larger than the chunk size travels as chunks published to `<topic>/chunk/<index>`
(`protocols.topics.chunk_topic`), so a retained large message survives on the broker as a set of
retained chunk topics and a late subscriber receives all of them. Every chunk starts with a fixed
header:

    magic "PFC" 0x01 | transfer id (16 bytes) | index (u32) | count (u32) | total length (u64)
    | SHA-256 of the whole payload (32 bytes)                                 (big-endian, 68 bytes)

The receiver keys partial sets by (base topic, transfer id), so two transfers to one topic never
mix, and checks length and SHA-256 before handing the payload on. The transfer id is taken from
the payload's SHA-256: a payload sent again (a model republished after a reconnect, an update
re-sent) has the same chunks under the same id, so the receiver completes the set it already
holds from the chunks it misses instead of starting over. No I/O happens here.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from protocols.errors import ProtocolError
from protocols.topics import chunk_topic

logger = logging.getLogger(__name__)

MAGIC: Final = b"PFC\x01"
HEADER: Final = struct.Struct(">4s16sIIQ32s")
_REMEMBERED_TRANSFERS: Final = 1024
CHUNK_COST_BYTES: Final = 144
"""Memory one held chunk takes beyond its body: the bytes object's header, its index and its
slot (90 bytes by tracemalloc, ~143 in the process's RSS with one-byte chunks). Every held chunk
is charged its body plus this, so a flood of tiny chunks pays for the memory it really takes."""
_EXPIRE_EVERY_S: Final = 1.0

DropReporter = Callable[[str, str, str], object]
"""Told (sender, topic, reason) of each dropped transfer; rate-limits its own logging."""


def _log_drop(sender: str, topic: str, reason: str) -> None:
    logger.warning("dropping a chunked message from %s on %s: %s", sender or "-", topic, reason)


@dataclass(frozen=True)
class ChunkHeader:
    """The fixed header every chunk carries."""

    transfer_id: bytes
    index: int
    count: int
    total_length: int
    sha256: bytes


def chunk_count(payload_length: int, chunk_size: int) -> int:
    """How many chunks a payload needs; 0 means it travels whole, as one message.

    A chunk, header included, never exceeds `chunk_size`, so a broker configured to accept
    `chunk_size` bytes accepts every message this module produces.
    """
    if payload_length <= chunk_size:
        return 0
    body = _body_size(chunk_size)
    return -(-payload_length // body)


def split(payload: bytes, chunk_size: int, transfer_id: bytes | None = None) -> list[bytes]:
    """Cut `payload` into chunks of at most `chunk_size` bytes each, header included.

    Args:
        payload: the whole message; must be larger than `chunk_size` (smaller ones travel whole).
        chunk_size: the largest chunk, header included.
        transfer_id: 16 bytes naming this transfer; by default the first 16 bytes of the
            payload's SHA-256, so two different payloads to one topic stay apart on the receiver
            and the same payload sent twice fills one set.
    """
    count = chunk_count(len(payload), chunk_size)
    if count == 0:
        msg = f"a payload of {len(payload)} bytes fits in one {chunk_size}-byte message"
        raise ValueError(msg)
    digest = hashlib.sha256(payload).digest()
    transfer_id = digest[:16] if transfer_id is None else transfer_id
    if len(transfer_id) != 16:
        msg = f"transfer id must be 16 bytes, got {len(transfer_id)}"
        raise ValueError(msg)
    body = _body_size(chunk_size)
    view = memoryview(payload)
    return [
        HEADER.pack(MAGIC, transfer_id, index, count, len(payload), digest)
        + view[index * body : (index + 1) * body]
        for index in range(count)
    ]


def messages_for(
    topic: str, payload: bytes, chunk_size: int, replaces: int | None = None
) -> list[tuple[str, bytes]]:
    """The (topic, payload) MQTT messages that carry `payload` to `topic`, in publish order.

    Args:
        topic: the base topic.
        payload: the whole message.
        chunk_size: the largest MQTT payload to produce.
        replaces: for a retained publish, how many chunks the retained message it replaces had
            (0 for one whole message, None when unknown or not retained). The stale retained
            topics it left are cleared with empty payloads, so a late subscriber never receives
            an old chunk set, or an old whole message, next to the new one.
    """
    count = chunk_count(len(payload), chunk_size)
    if count == 0:
        messages = [(topic, payload)]
    else:
        messages = [
            (chunk_topic(topic, index), chunk)
            for index, chunk in enumerate(split(payload, chunk_size))
        ]
    if replaces is None:
        return messages
    if count and replaces == 0:
        return [(topic, b""), *messages]
    return messages + [(chunk_topic(topic, index), b"") for index in range(count, replaces)]


def decode_chunk(chunk: bytes) -> tuple[ChunkHeader, bytes]:
    """Read a chunk's header and body.

    Raises:
        ProtocolError: the bytes are not a well-formed chunk.
    """
    if len(chunk) <= HEADER.size:
        msg = f"chunk of {len(chunk)} bytes is shorter than its {HEADER.size}-byte header + data"
        raise ProtocolError(msg)
    magic, transfer_id, index, count, total, digest = HEADER.unpack_from(chunk)
    if magic != MAGIC:
        msg = f"chunk has magic {magic!r}, expected {MAGIC!r}"
        raise ProtocolError(msg)
    if count < 2 or index >= count or total < count:
        msg = f"chunk header is inconsistent: index {index}, count {count}, total length {total}"
        raise ProtocolError(msg)
    return ChunkHeader(transfer_id, index, count, total, digest), chunk[HEADER.size :]


def _body_size(chunk_size: int) -> int:
    if chunk_size <= HEADER.size:
        msg = f"chunk size {chunk_size} leaves no room after the {HEADER.size}-byte header"
        raise ValueError(msg)
    return chunk_size - HEADER.size


@dataclass
class _PartialSet:
    header: ChunkHeader
    sender: str
    started: float
    touched: float
    parts: dict[int, bytes] = field(default_factory=dict)
    held: int = 0
    """Bytes of chunk data: at most the declared total length."""
    cost: int = 0
    """Memory charged for the held chunks: their bytes plus CHUNK_COST_BYTES each."""


class Reassembler:
    """Collects chunks per (base topic, transfer id) and returns each payload once complete.

    Built for QoS 1: duplicates are harmless, order does not matter. A flood of chunks that
    never complete can neither exhaust memory nor slow the rest: each sender (`sender_of` the
    base topic) holds at most `max_transfers_per_sender` incomplete sets and `max_payload_bytes`
    of memory (chunk data plus CHUNK_COST_BYTES per chunk), a new set or chunk over either drops
    that sender's own oldest set, a transfer whose declared length and chunk count cannot fit
    is refused at its first chunk, the total is capped by dropping from the largest holder, and
    idle sets are swept at most once a second, so the work per chunk does not grow with the
    number of open sets. Every drop is reported against its sender (`on_drop`).
    """

    def __init__(
        self,
        max_payload_bytes: int,
        timeout_s: float = 120.0,
        *,
        max_transfers_per_sender: int = 4,
        sender_of: Callable[[str], str] = lambda topic: "",
        on_drop: DropReporter = _log_drop,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.timeout_s = timeout_s
        self.max_transfers_per_sender = max_transfers_per_sender
        self._sender_of = sender_of
        self._on_drop = on_drop
        self._sets: OrderedDict[tuple[str, bytes], _PartialSet] = OrderedDict()
        self._finished: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._refused: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._held = 0
        self._held_by: Counter[str] = Counter()
        self._open_by: Counter[str] = Counter()
        self._last_expire = float("-inf")

    @property
    def held_bytes(self) -> int:
        """Memory charged for incomplete sets: chunk data plus CHUNK_COST_BYTES per chunk."""
        return self._held

    @property
    def pending(self) -> int:
        """How many incomplete sets are held."""
        return len(self._sets)

    def add(self, base_topic: str, chunk: bytes, now: float | None = None) -> bytes | None:
        """Take one chunk; return the whole payload when this chunk completes it, else None.

        Raises:
            ProtocolError: the chunk is malformed, contradicts earlier chunks of its transfer,
                or completes a payload whose length or SHA-256 does not match (the set is
                dropped; the caller logs and moves on).
        """
        now = time.monotonic() if now is None else now
        header, body = decode_chunk(chunk)
        key = (base_topic, header.transfer_id)
        if key in self._refused:
            return None
        partial = self._sets.get(key)
        if partial is None:
            sender = self._sender_of(base_topic)
            if not self._admit(key, header, sender):
                return None
            partial = self._sets[key] = _PartialSet(header, sender, started=now, touched=now)
            self._open_by[sender] += 1
        elif _differs(partial.header, header):
            self._drop(key)
            msg = f"chunk {header.index} contradicts earlier chunks of its transfer"
            raise ProtocolError(msg, topic=base_topic)
        partial.touched = now
        if header.index in partial.parts:
            return None
        if partial.held + len(body) > header.total_length:
            self._drop(key)
            msg = f"chunks carry more than the declared {header.total_length} bytes"
            raise ProtocolError(msg, topic=base_topic)
        cost = len(body) + CHUNK_COST_BYTES
        self._make_room(cost, keep=key)
        partial.parts[header.index] = body
        partial.held += len(body)
        partial.cost += cost
        self._held += cost
        self._held_by[partial.sender] += cost
        if len(partial.parts) < header.count:
            return None
        return self._complete(key, partial)

    def expire_due(self, now: float | None = None) -> list[str]:
        """`expire`, at most once a second: constant work per chunk during a flood."""
        now = time.monotonic() if now is None else now
        if now - self._last_expire < _EXPIRE_EVERY_S:
            return []
        return self.expire(now)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop sets that received nothing for `timeout_s`; return their base topics."""
        now = time.monotonic() if now is None else now
        self._last_expire = now
        stale = [key for key, part in self._sets.items() if now - part.touched > self.timeout_s]
        for key in stale:
            partial = self._sets[key]
            reason = (
                f"incomplete: {len(partial.parts)} of {partial.header.count} chunks after "
                f"{now - partial.started:.0f} s"
            )
            # A chunk redelivered after its transfer completed (QoS 1) opens a set that can never
            # finish; that is expected, so it is not worth a warning.
            if key in self._finished:
                logger.debug("dropping %s on %s", reason, key[0])
            else:
                self._on_drop(partial.sender, key[0], reason)
            self._drop(key)
        return [key[0] for key in stale]

    def _admit(self, key: tuple[str, bytes], header: ChunkHeader, sender: str) -> bool:
        cost = header.total_length + header.count * CHUNK_COST_BYTES
        if cost > self.max_payload_bytes:
            _remember(self._refused, key)
            reason = (
                f"{header.total_length} bytes in {header.count} chunks would hold {cost} bytes "
                f"of memory, over the {self.max_payload_bytes}-byte limit"
            )
            self._on_drop(sender, key[0], reason)
            return False
        # the fleet's own channel (sender "") is the coordinator: trusted, not capped per sender
        if sender and self._open_by[sender] >= self.max_transfers_per_sender:
            oldest = next(k for k, part in self._sets.items() if part.sender == sender)
            reason = f"more than {self.max_transfers_per_sender} incomplete transfers"
            self._on_drop(sender, oldest[0], f"{reason} (its oldest dropped)")
            self._drop(oldest)
        return True

    def _make_room(self, size: int, keep: tuple[str, bytes]) -> None:
        sender = self._sets[keep].sender
        while self._held_by[sender] + size > self.max_payload_bytes:
            own = next((k for k, p in self._sets.items() if p.sender == sender and k != keep), None)
            if own is None:
                break  # only `keep` is left, and _admit bounded its cost by its declaration
            self._on_drop(sender, own[0], "its partial messages would exceed the memory limit")
            self._drop(own)
        while self._held + size > self.max_payload_bytes:
            holders: Counter[str] = Counter()
            for key, partial in self._sets.items():
                if key != keep:
                    holders[partial.sender] += partial.cost
            if not holders:
                return
            largest = holders.most_common(1)[0][0]
            victim = next(k for k, p in self._sets.items() if p.sender == largest and k != keep)
            self._on_drop(largest, victim[0], "partial messages of all senders exceed the limit")
            self._drop(victim)

    def _complete(self, key: tuple[str, bytes], partial: _PartialSet) -> bytes:
        self._drop(key)
        payload = b"".join(partial.parts[index] for index in range(partial.header.count))
        if len(payload) != partial.header.total_length:
            msg = f"reassembled {len(payload)} bytes, header declared {partial.header.total_length}"
            raise ProtocolError(msg, topic=key[0])
        if hashlib.sha256(payload).digest() != partial.header.sha256:
            msg = f"SHA-256 of the reassembled {len(payload)} bytes does not match the header"
            raise ProtocolError(msg, topic=key[0])
        _remember(self._finished, key)
        return payload

    def _drop(self, key: tuple[str, bytes]) -> None:
        partial = self._sets.pop(key, None)
        if partial is not None:
            self._held -= partial.cost
            self._held_by[partial.sender] -= partial.cost
            if self._held_by[partial.sender] <= 0:
                del self._held_by[partial.sender]
            self._open_by[partial.sender] -= 1
            if self._open_by[partial.sender] <= 0:
                del self._open_by[partial.sender]


def _differs(first: ChunkHeader, other: ChunkHeader) -> bool:
    return (first.count, first.total_length, first.sha256) != (
        other.count,
        other.total_length,
        other.sha256,
    )


def _remember(keys: OrderedDict[tuple[str, bytes], None], key: tuple[str, bytes]) -> None:
    keys[key] = None
    keys.move_to_end(key)
    while len(keys) > _REMEMBERED_TRANSFERS:
        keys.popitem(last=False)
