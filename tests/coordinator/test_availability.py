"""Simulated speeds and sessions: their statistics, traces, and when a job ends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.scheduling.availability import (
    AvailabilitySpec,
    DeviceTiming,
    SimulatedClock,
    lognormal_speeds,
    parse_speeds,
)

IDS = [f"dev-{i:04d}" for i in range(200)]


def test_lognormal_speeds_span_the_asked_ratio_between_the_5th_and_95th_percentile() -> None:
    speeds = lognormal_speeds(100_000, 10.0, np.random.default_rng(0))
    low, median, high = np.percentile(speeds, [5, 50, 95])
    assert high / low == pytest.approx(10.0, rel=0.03)
    assert median == pytest.approx(1.0, rel=0.02)
    assert set(lognormal_speeds(5, 1.0, np.random.default_rng(0))) == {1.0}
    assert parse_speeds("lognormal:10") == 10.0
    with pytest.raises(ValueError, match="lognormal"):
        parse_speeds("lognormal:0.5")


def test_a_job_lasts_latency_plus_samples_times_epochs_over_speed() -> None:
    clock = SimulatedClock(["a"], 0, speed_ratio=10.0, timing=DeviceTiming(0.02, 3.0))
    clock.now = 100.0
    finish, survives = clock.job("a", 50, 2)
    assert survives
    assert finish == pytest.approx(100.0 + 3.0 + 50 * 2 * 0.02 / clock.speeds["a"])


def test_diurnal_devices_are_online_their_fraction_of_each_period_at_their_own_phase() -> None:
    spec = AvailabilitySpec.parse("diurnal:0.3:1000")
    clock = SimulatedClock(IDS, 1, availability=spec)
    online = []
    for t in np.arange(0, 3000, 10.0):
        clock.now = float(t)
        online.append([clock.online(d) for d in IDS])
    share = np.array(online, dtype=float)
    assert share.mean() == pytest.approx(0.3, abs=0.01)  # of device-time
    assert 0.15 < share[0].mean() < 0.45  # phases spread over the period
    assert np.array_equal(share[:100], share[100:200])  # the pattern repeats every period


def test_random_dropouts_cut_sessions_into_stretches_of_the_mean_uptime() -> None:
    spec = AvailabilitySpec.parse("always", uptime_s=60.0, downtime_s=20.0)
    clock = SimulatedClock(IDS, 2, availability=spec)
    sessions = clock.sessions[IDS[0]]
    sessions.online(100_000.0)
    lengths = np.array(sessions._ends) - np.array(sessions._starts)
    gaps = np.array(sessions._starts[1:]) - np.array(sessions._ends[:-1])
    assert lengths.mean() == pytest.approx(60.0, rel=0.15)
    assert np.allclose(gaps, 20.0)


def test_a_job_longer_than_the_session_ends_when_the_device_leaves(tmp_path: Path) -> None:
    trace = tmp_path / "sessions.csv"
    trace.write_text("device,start_s,end_s\na,0,10\na,8,12\nb,5,6\na,20,30\n")
    clock = SimulatedClock(
        ["a", "b", "c"], 0, availability=AvailabilitySpec.parse(f"trace:{trace}")
    )
    clock.now = 9.0
    assert clock.job("a", 1000, 1) == (12.0, False)  # the overlapping rows were merged
    assert clock.job("a", 100, 1)[1]  # 1 s latency + 1 s of training fits
    clock.now = 13.0
    assert not clock.online("a")
    assert clock.next_online(["a", "b", "c"]) == 20.0
    assert not clock.online("c")  # no row: never online
    clock.now = 35.0  # the trace repeats after its last end (30 s)
    assert clock.online("b")


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ("device,start\na,0\n", "columns"),
        ("device,start_s,end_s\na,5,1\n", "start_s < end_s"),
        ("device,start_s,end_s\na,x,1\n", "numbers"),
        ("device,start_s,end_s\n", "no sessions"),
    ],
)
def test_a_malformed_trace_is_refused_with_its_line(tmp_path: Path, rows: str, match: str) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(rows)
    with pytest.raises(ValueError, match=match):
        AvailabilitySpec.parse(f"trace:{trace}")


@pytest.mark.parametrize("text", ["sometimes", "diurnal:1.5", "diurnal:0.5:-1", "trace:"])
def test_an_unknown_availability_names_the_forms_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match="availability"):
        AvailabilitySpec.parse(text)
