"""Dropped messages are counted per device and logged once per device per interval."""

from __future__ import annotations

import logging

import pytest

from protocols.offences import Offences


def test_a_flood_writes_one_line_per_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    offences = Offences(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="protocols.offences"):
        logged = [offences.record("evil", "t", f"bad {i}") for i in range(1000)]
        now[0] = 10.5
        logged.append(offences.record("evil", "t", "bad last"))
        logged.append(offences.record("honest", "t", "stale round"))
    assert logged.count(True) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "dropped 1000 messages from evil" in lines[1]
    assert "bad last" in lines[1]
    assert "honest" in lines[2]
    assert offences.counts() == {"evil": 1001, "honest": 1}
