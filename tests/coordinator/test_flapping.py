"""An id that keeps rejoining is named, once, and forgotten when it settles."""

from __future__ import annotations

import logging

import pytest

from coordinator.flapping import FlapWatch


def test_three_joins_within_the_window_flap_and_quiet_ones_do_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    watch = FlapWatch(threshold=3, window_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    assert [watch.note("dev-1") for _ in range(2)] == [False, False]
    now[0] = 20.0
    assert watch.note("dev-1")
    assert not watch.note("dev-1")  # said once
    assert watch.flapping() == {"dev-1"}
    now[0] = 100.0  # a minute of quiet
    assert watch.flapping() == frozenset()
    for moment in (100.0, 140.0, 180.0):  # a normal reconnect every 40 s
        now[0] = moment
        assert not watch.note("dev-2")
    assert len([r for r in caplog.records if "two devices probably run" in r.getMessage()]) == 1
