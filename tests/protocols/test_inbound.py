"""A flooding sender is cut at its own rate, queue and transfer limits; others are still served."""

from __future__ import annotations

import os
import tracemalloc

from protocols.transport import chunking
from protocols.transport.inbound import FLEET_CHANNEL, FairInbox, TokenBucket, sender_of


def test_senders_are_the_device_of_a_device_topic_or_the_fleet_channel() -> None:
    assert sender_of("pfl/f/device/dev-1/update") == "dev-1"
    assert sender_of("pfl/f/device/dev-1/update/chunk/7") == "dev-1"
    assert sender_of("pfl/f/model") == FLEET_CHANNEL
    assert sender_of("elsewhere/x") == "?"


def test_the_token_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=10, burst=5, now=0.0)
    assert [bucket.take(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert bucket.take(0.1)  # one token back after 0.1 s
    assert not bucket.take(0.1)


def test_a_flood_neither_starves_nor_evicts_an_honest_sender() -> None:
    now = [0.0]
    inbox: FairInbox[str] = FairInbox(per_sender=100, rate=1000, burst=500, clock=lambda: now[0])
    drops = [inbox.put("evil", f"evil-{i}") for i in range(10_000)]
    assert drops.count("") == 100  # the rest was over the rate or over its queue
    assert any("messages/s" in d for d in drops)
    assert any("queued" in d for d in drops)
    assert inbox.put("honest", "hello") == ""
    assert inbox.put(FLEET_CHANNEL, "model") == ""
    served = [inbox.get(0.1)[1] for _ in range(3)]
    assert "hello" in served
    assert "model" in served
    assert inbox.queued() == 100 - 1  # only the evil sender's own messages were lost


def test_one_sender_keeps_at_most_its_transfers_and_bytes_open() -> None:
    drops: list[tuple[str, str, str]] = []
    reassembler = chunking.Reassembler(
        10_000,
        max_transfers_per_sender=4,
        sender_of=sender_of,
        on_drop=lambda *drop: drops.append(drop),
    )
    evil_topic = "pfl/f/device/evil/update"
    for _ in range(1000):  # never-completing transfers: the first chunk of each
        reassembler.add(evil_topic, chunking.split(os.urandom(300), 200)[0], now=0.0)
    assert reassembler.pending == 4
    assert {sender for sender, _, _ in drops} == {"evil"}
    payload = os.urandom(2000)
    chunks = chunking.split(payload, 500)
    results = [reassembler.add("pfl/f/device/honest/update", c, now=0.0) for c in chunks]
    assert results[-1] == payload


def test_idle_sets_are_swept_at_most_once_a_second() -> None:
    reassembler = chunking.Reassembler(10_000, timeout_s=1.0, on_drop=lambda *_: None)
    reassembler.add("pfl/f/model", chunking.split(os.urandom(300), 200)[0], now=0.0)
    assert reassembler.expire_due(now=5.0) == ["pfl/f/model"]
    reassembler.add("pfl/f/model", chunking.split(os.urandom(300), 200)[0], now=5.0)
    assert reassembler.expire_due(now=5.5) == []  # swept 0.5 s ago: not yet
    assert reassembler.expire_due(now=7.0) == ["pfl/f/model"]


def _tiny_chunks(count: int, body: bytes) -> list[bytes]:
    """The chunks of a transfer declaring `count` chunks of `body` each (it never completes)."""
    transfer_id = os.urandom(16)
    total = count * len(body)
    return [
        chunking.HEADER.pack(chunking.MAGIC, transfer_id, index, count, total, b"\0" * 32) + body
        for index in range(count)
    ]


def test_tiny_chunks_are_charged_the_memory_they_take_and_counted_against_their_sender() -> None:
    # Prepare: four transfers of 1000 two-byte chunks each (as many as a sender may open)
    limit = 256 * 1024
    drops: list[tuple[str, str, str]] = []
    reassembler = chunking.Reassembler(
        limit, sender_of=sender_of, on_drop=lambda *drop: drops.append(drop)
    )
    transfers = [_tiny_chunks(1000, b"xy") for _ in range(4)]
    evil_topic = "pfl/f/device/evil/update"
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]

    # Execute
    for chunks in transfers:
        for chunk in chunks[:-1]:
            reassembler.add(evil_topic, chunk, now=0.0)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()

    # Assert: what the reassembler holds (really, not just its bodies) stays under the limit
    assert grown <= limit
    assert reassembler.held_bytes <= limit
    assert drops
    assert {sender for sender, _, _ in drops} == {"evil"}
    payload = os.urandom(2000)
    results = [
        reassembler.add("pfl/f/device/honest/update", c) for c in chunking.split(payload, 500)
    ]
    assert results[-1] == payload


def test_a_transfer_whose_chunk_count_cannot_fit_is_refused_at_its_first_chunk() -> None:
    # Prepare: 100 bytes of data in 100 one-byte chunks: 100 + 100 * 144 bytes of memory
    drops: list[tuple[str, str, str]] = []
    reassembler = chunking.Reassembler(
        10_000, sender_of=sender_of, on_drop=lambda *drop: drops.append(drop)
    )

    # Execute
    for chunk in _tiny_chunks(100, b"z"):
        reassembler.add("pfl/f/device/evil/update", chunk, now=0.0)

    # Assert: one drop, nothing held
    assert reassembler.pending == 0
    assert reassembler.held_bytes == 0
    assert [(sender, reason) for sender, _, reason in drops] == [
        (
            "evil",
            "100 bytes in 100 chunks would hold 14500 bytes of memory, over the 10000-byte limit",
        )
    ]
