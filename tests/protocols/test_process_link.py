"""Frames between a simulation's hub and its workers: raw bytes both ways, no pickle."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from typing import Any

import pytest

from protocols.transport.process_hub import ProcessHub, WorkerLink
from protocols.transport.process_link import (
    DELIVER,
    KEEP,
    KEEP_MIN_BYTES,
    KEPT,
    PUBLISH,
    Frame,
    RemoteTransport,
    WorkerEnd,
    decode_link_frame,
    encode_link_frame,
)


def test_a_frame_comes_back_as_it_went_with_any_payload_bytes() -> None:
    payload = bytes(range(256)) * 3
    for frame in (
        Frame(PUBLISH, {"d": 3, "t": "pfl/f/device/dev-0003/update", "r": False}, payload),
        Frame(DELIVER, {"t": "pfl/f/round", "s": [1, 5, 9]}, b""),
    ):
        assert decode_link_frame(encode_link_frame(frame)) == frame


@pytest.mark.parametrize(
    "data",
    [b"", b"P\x05\x00\x00", b"P\x10\x00\x00\x00{}", b"P\x02\x00\x00\x00[]", b"P\x02\x00\x00\x00{x"],
)
def test_a_short_or_broken_frame_is_refused_with_a_reason(data: bytes) -> None:
    with pytest.raises(ValueError, match="link frame"):
        decode_link_frame(data)


def _link(context: Any) -> tuple[WorkerLink, Connection, Connection]:
    """A hub's link over real pipes, with its worker's ends for the test to play the worker."""
    down_reader, down_writer = context.Pipe(duplex=False)
    up_reader, up_writer = context.Pipe(duplex=False)
    process = context.Process(target=int)  # stands in for the worker, which the test plays
    process.start()
    link = WorkerLink(0, down_writer, up_reader, process)
    link.start()
    return link, down_reader, up_writer


def test_a_retained_model_goes_down_a_link_once_and_then_by_reference() -> None:
    context = multiprocessing.get_context("fork")
    hub = ProcessHub()
    link, _down, up = _link(context)
    hub.links.append(link)
    end = WorkerEnd(up)
    seen: list[tuple[str, bytes]] = []
    device = RemoteTransport(end, 0, "dev-0000")
    subscriptions = [end.register(device, lambda t, p: seen.append((t, p))) for _ in range(3)]
    model, newer, status = b"m" * KEEP_MIN_BYTES, b"n" * KEEP_MIN_BYTES, b"s" * 10
    publisher = hub.connect("coordinator")
    publisher.publish("pfl/f/model", model, retain=True)
    publisher.publish("pfl/f/status", status, retain=True)
    delivery = hub._queue.popleft()
    frames = [hub._delivery_frame(link, delivery, [s]) for s in subscriptions]
    assert [f.header.get("k") for f in frames] == [KEEP, KEPT, KEPT]
    assert [len(f.payload) for f in frames] == [len(model), 0, 0]
    small = hub._delivery_frame(link, hub._queue.popleft(), subscriptions[:1])
    assert "k" not in small.header
    assert small.payload == status
    publisher.publish("pfl/f/model", newer, retain=True)
    assert hub._delivery_frame(link, hub._queue.popleft(), [1]).header["k"] == KEEP
    publisher.publish("pfl/f/model/not-retained", newer)
    assert "k" not in hub._delivery_frame(link, hub._queue.popleft(), [1]).header
    for frame in frames:  # the worker hands the kept bytes to every subscriber
        end.deliver(decode_link_frame(encode_link_frame(frame)))
    assert seen == [("pfl/f/model", model)] * 3
    link.stop()


def test_frames_reach_the_worker_in_the_order_sent_whether_sent_at_once_or_queued() -> None:
    context = multiprocessing.get_context("fork")
    link, down, _ = _link(context)
    big = b"x" * 200_000  # more than a pipe holds: queued for the writer, which blocks on it
    sent = [Frame(DELIVER, {"t": "a", "s": [i]}, big if i % 3 == 0 else b"y") for i in range(30)]
    for frame in sent:
        link.send(frame)
    received = [decode_link_frame(down.recv_bytes()) for _ in sent]
    assert [f.header["s"] for f in received] == [f.header["s"] for f in sent]
    assert [len(f.payload) for f in received] == [len(f.payload) for f in sent]
    link.stop()
