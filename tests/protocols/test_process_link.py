"""Frames between a simulation's hub and its workers: raw bytes both ways, no pickle."""

from __future__ import annotations

import pytest

from protocols.transport.process_link import (
    DELIVER,
    PUBLISH,
    Frame,
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
