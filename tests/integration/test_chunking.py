"""Chunking of large payloads: split and reassembly alone, then 40 MB through real brokers."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from protocols.errors import ProtocolError
from protocols.transport import chunking
from protocols.transport.chunking import HEADER, Reassembler
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings

# -- split and reassemble, no broker ----------------------------------------------------------

CHUNK = 1024
BODY = CHUNK - HEADER.size


def _chunks(payload: bytes, transfer_id: bytes | None = None) -> list[bytes]:
    return chunking.split(payload, CHUNK, transfer_id)


def test_small_payload_travels_whole_and_large_one_in_bounded_chunks() -> None:
    # Prepare
    small, large = os.urandom(CHUNK), os.urandom(5 * BODY + 7)

    # Execute
    small_messages = chunking.messages_for("t", small, CHUNK)
    large_messages = chunking.messages_for("t", large, CHUNK)

    # Assert
    assert small_messages == [("t", small)]
    assert [topic for topic, _ in large_messages] == [f"t/chunk/{i}" for i in range(6)]
    assert all(len(chunk) <= CHUNK for _, chunk in large_messages)
    header, body = chunking.decode_chunk(large_messages[5][1])
    assert (header.index, header.count, header.total_length) == (5, 6, len(large))
    assert header.sha256 == hashlib.sha256(large).digest()
    assert len(body) == 7


def test_split_then_reassemble_in_order_gives_the_payload_once() -> None:
    payload = os.urandom(10 * BODY + 1)
    reassembler = Reassembler(max_payload_bytes=1 << 20)

    results = [reassembler.add("a/b", chunk) for chunk in _chunks(payload)]

    assert results[:-1] == [None] * (len(results) - 1)
    assert results[-1] == payload
    assert reassembler.pending == 0
    assert reassembler.held_bytes == 0


def test_out_of_order_and_duplicated_chunks_still_reassemble() -> None:
    payload = os.urandom(8 * BODY)
    chunks = _chunks(payload)
    shuffled = chunks[3:] + chunks[:3]
    random.Random(7).shuffle(shuffled)
    reassembler = Reassembler(max_payload_bytes=1 << 20)

    results = [reassembler.add("t", chunk) for chunk in [chunks[0], chunks[0], *shuffled]]

    complete = [r for r in results if r is not None]
    assert complete == [payload]


def test_two_transfers_on_one_topic_do_not_mix() -> None:
    first, second = os.urandom(3 * BODY), os.urandom(3 * BODY)
    a, b = _chunks(first, b"A" * 16), _chunks(second, b"B" * 16)
    reassembler = Reassembler(max_payload_bytes=1 << 20)

    results = [reassembler.add("t", chunk) for pair in zip(a, b, strict=True) for chunk in pair]

    assert [r for r in results if r is not None] == [first, second]


def test_a_payload_sent_again_completes_the_set_held_from_the_first_send() -> None:
    payload, other = os.urandom(6 * BODY), os.urandom(6 * BODY)
    first_send, second_send = _chunks(payload), _chunks(payload)
    reassembler = Reassembler(max_payload_bytes=1 << 20)
    for chunk in first_send[:4]:  # the link was cut after four chunks
        assert reassembler.add("t", chunk) is None

    # only the two missing chunks of the second send are needed; another payload stays apart
    assert reassembler.add("t", _chunks(other)[4]) is None
    assert reassembler.add("t", second_send[4]) is None
    assert reassembler.add("t", second_send[5]) == payload
    assert (
        chunking.decode_chunk(first_send[0])[0].transfer_id == hashlib.sha256(payload).digest()[:16]
    )


def test_corrupted_body_is_rejected_at_completion() -> None:
    payload = os.urandom(4 * BODY)
    chunks = _chunks(payload)
    broken = bytearray(chunks[2])
    broken[-1] ^= 0xFF
    chunks[2] = bytes(broken)
    reassembler = Reassembler(max_payload_bytes=1 << 20)

    for chunk in chunks[:-1]:
        assert reassembler.add("t", chunk) is None
    with pytest.raises(ProtocolError, match="SHA-256"):
        reassembler.add("t", chunks[-1])
    assert reassembler.pending == 0
    assert reassembler.held_bytes == 0


@pytest.mark.parametrize(
    "chunk",
    [
        b"PFC\x01short",
        b"XXXX" + bytes(HEADER.size),
        HEADER.pack(chunking.MAGIC, bytes(16), 5, 3, 3000, bytes(32)) + b"x",  # index >= count
    ],
)
def test_malformed_chunk_raises_protocol_error(chunk: bytes) -> None:
    with pytest.raises(ProtocolError):
        Reassembler(max_payload_bytes=1 << 20).add("t", chunk)


def test_chunk_contradicting_its_transfer_drops_the_set() -> None:
    chunks = _chunks(os.urandom(3 * BODY), b"T" * 16)
    liar = _chunks(os.urandom(4 * BODY), b"T" * 16)[1]  # same transfer id, other count
    reassembler = Reassembler(max_payload_bytes=1 << 20)
    reassembler.add("t", chunks[0])

    with pytest.raises(ProtocolError, match="contradicts"):
        reassembler.add("t", liar)
    assert reassembler.pending == 0


def test_incomplete_set_is_dropped_after_the_timeout_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chunks = _chunks(os.urandom(3 * BODY))
    reassembler = Reassembler(max_payload_bytes=1 << 20, timeout_s=10)
    reassembler.add("pfl/f/model", chunks[0], now=100.0)
    reassembler.add("pfl/f/model", chunks[1], now=105.0)

    with caplog.at_level(logging.WARNING, logger="protocols.transport.chunking"):
        kept = reassembler.expire(now=114.0)  # 9 s after the last chunk: still alive
        dropped = reassembler.expire(now=116.0)

    assert kept == []
    assert dropped == ["pfl/f/model"]
    assert reassembler.pending == 0
    assert reassembler.held_bytes == 0
    assert "pfl/f/model" in caplog.text
    assert reassembler.add("pfl/f/model", chunks[2], now=117.0) is None  # set is gone


def test_payload_above_the_cap_is_refused_without_holding_memory() -> None:
    chunks = _chunks(os.urandom(6 * BODY))
    reassembler = Reassembler(max_payload_bytes=5 * BODY)

    results = [reassembler.add("t", chunk) for chunk in chunks]

    assert results == [None] * len(chunks)
    assert reassembler.held_bytes == 0


def test_memory_cap_evicts_the_oldest_partial_set() -> None:
    first, second = os.urandom(4 * BODY), os.urandom(4 * BODY)
    a, b = _chunks(first, b"A" * 16), _chunks(second, b"B" * 16)
    reassembler = Reassembler(max_payload_bytes=5 * BODY)
    for chunk in a[:3]:
        reassembler.add("t", chunk)

    results = [reassembler.add("t", chunk) for chunk in b]

    assert results[-1] == second
    assert reassembler.held_bytes <= 5 * BODY
    assert all(reassembler.add("t", chunk) is None for chunk in a[3:])  # first set was evicted


def test_retained_replacement_clears_stale_chunk_topics() -> None:
    large, smaller, small = os.urandom(5 * BODY), os.urandom(2 * BODY), b"tiny"

    fewer = chunking.messages_for("m", smaller, CHUNK, replaces=5)
    whole = chunking.messages_for("m", small, CHUNK, replaces=2)
    bigger = chunking.messages_for("m", large, CHUNK, replaces=0)

    assert [(t, p) for t, p in fewer if not p] == [(f"m/chunk/{i}", b"") for i in (2, 3, 4)]
    assert whole == [("m", small), ("m/chunk/0", b""), ("m/chunk/1", b"")]
    assert bigger[0] == ("m", b"")  # the old whole message on the base topic goes first
    assert len(bigger) == 1 + 5


# -- through real brokers -----------------------------------------------------------------------

LARGE = 40_000_000  # 10M float32 parameters
logger = logging.getLogger(__name__)

Connect = Callable[..., MqttTransport]


class Digests:
    """Records (topic, length, SHA-256) of what arrives, without keeping 40 MB copies."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bytes]] = []
        self._lock = threading.Lock()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self.seen.append((topic, len(payload), hashlib.sha256(payload).digest()))

    def has(self, count: int) -> Callable[[], bool]:
        return lambda: len(self.seen) >= count


def _digest(topic: str, payload: bytes) -> tuple[str, int, bytes]:
    return topic, len(payload), hashlib.sha256(payload).digest()


@pytest.fixture(scope="module")
def model() -> bytes:
    return os.urandom(LARGE)


@pytest.fixture
def connect() -> Iterator[Connect]:
    opened: list[MqttTransport] = []

    def open_transport(url: str, client_id: str, **fields: Any) -> MqttTransport:
        transport = MqttTransport(BrokerSettings(url=url, **fields), client_id)
        opened.append(transport)
        return transport

    yield open_transport
    for transport in opened:
        transport.close()


def test_40_mb_payload_arrives_intact_in_both_directions(
    broker_url: str, connect: Connect, model: bytes
) -> None:
    # Prepare
    coordinator, device = connect(broker_url, "big-coordinator"), connect(broker_url, "big-device")
    at_device, at_coordinator = Digests(), Digests()
    device.subscribe("pfl/f/model", at_device)
    coordinator.subscribe("pfl/f/device/+/update", at_coordinator)
    update = model[::-1]

    # Execute
    started = time.monotonic()
    coordinator.publish("pfl/f/model", model)
    assert device.wait_until(at_device.has(1), timeout_s=30)
    downlink_s = time.monotonic() - started
    device.publish("pfl/f/device/d1/update", update)
    assert coordinator.wait_until(at_coordinator.has(1), timeout_s=30)
    logger.info("40 MB on %s: %.2f s down, %.2f s both", broker_url, downlink_s,
                time.monotonic() - started)  # fmt: skip

    # Assert
    assert at_device.seen == [_digest("pfl/f/model", model)]
    assert at_coordinator.seen == [_digest("pfl/f/device/d1/update", update)]
    assert coordinator.stats.bytes_sent == LARGE
    assert device.stats.bytes_received == LARGE
    assert device.stats.wire_bytes_received > LARGE  # chunk headers
    assert device.stats.messages_received == 1


def test_40_mb_retained_model_reaches_a_late_subscriber(
    broker_url: str, connect: Connect, model: bytes
) -> None:
    coordinator = connect(broker_url, "late-coordinator")
    coordinator.publish("pfl/f/model", model, retain=True)
    assert coordinator.flush(30)
    late, digests = connect(broker_url, "late-device"), Digests()

    late.subscribe("pfl/f/model", digests)

    assert late.wait_until(digests.has(1), timeout_s=30)
    assert digests.seen == [_digest("pfl/f/model", model)]


@pytest.mark.parametrize("size", [11, 3 * 64 * 1024], ids=["whole", "fewer-chunks"])
def test_replacing_a_large_retained_message_leaves_no_stale_chunks(
    broker_url: str, connect: Connect, size: int
) -> None:
    # Prepare: 64 KiB chunks keep this quick; 1 MB makes 17 chunks, the replacement 0 or 4
    replacement = os.urandom(size)
    small_chunks = {"chunk_size_bytes": 64 * 1024}
    coordinator = connect(broker_url, "stale-coordinator", **small_chunks)
    coordinator.publish("pfl/f/model", os.urandom(1_000_000), retain=True)

    # Execute
    coordinator.publish("pfl/f/model", replacement, retain=True)
    assert coordinator.flush(10)
    late, digests = connect(broker_url, "stale-device", **small_chunks), Digests()
    late.subscribe("pfl/f/model", digests)
    assert late.wait_until(digests.has(1), timeout_s=10)
    late.wait_until(digests.has(2), timeout_s=0.5)  # give stale chunks a chance to show up

    # Assert: exactly the replacement, and no chunk of the old message on the wire
    assert digests.seen == [_digest("pfl/f/model", replacement)]
    assert late.stats.wire_bytes_received < len(replacement) + 4 * 100


def test_replacing_a_small_retained_message_with_a_large_one_clears_the_small_one(
    broker_url: str, connect: Connect
) -> None:
    small_chunks = {"chunk_size_bytes": 64 * 1024}
    coordinator = connect(broker_url, "grow-coordinator", **small_chunks)
    coordinator.publish("pfl/f/model", b"placeholder", retain=True)
    large = os.urandom(500_000)

    coordinator.publish("pfl/f/model", large, retain=True)
    assert coordinator.flush(10)
    late, digests = connect(broker_url, "grow-device", **small_chunks), Digests()
    late.subscribe("pfl/f/model", digests)
    assert late.wait_until(digests.has(1), timeout_s=10)
    late.wait_until(digests.has(2), timeout_s=0.5)

    assert digests.seen == [_digest("pfl/f/model", large)]
