"""Tests for the run states in the coordinator status and the per-device figures of protocol 9."""

from __future__ import annotations

import json

import pytest

from protocols.errors import ProtocolError
from protocols.messages import (
    MAX_LISTED_MISSING,
    MAX_STATUS_EVENTS,
    CoordinatorStatus,
    FleetDevice,
    FleetStatus,
    RoundSummary,
    RunEvent,
    dump_header,
    parse_header,
)
from protocols.versions import PROTOCOL_VERSION


def test_a_status_without_the_new_fields_still_decodes() -> None:
    # Arrange: a status as a reader that knows none of the run-state fields writes it
    raw = json.dumps(
        {
            "kind": "coordinator-status",
            "protocol_version": PROTOCOL_VERSION,
            "sent_at": 1.0,
            "state": "running",
            "fleet": "lab",
            "round_id": 3,
            "rounds": 10,
        }
    )

    # Act
    status = parse_header(raw)

    # Assert: the new fields take their "nothing to say" values
    assert isinstance(status, CoordinatorStatus)
    assert (status.state, status.missing, status.missing_count) == ("running", (), 0)
    assert (status.deadline, status.reason, status.events) == (None, "", ())


def test_old_fleet_rows_and_rounds_decode_without_bytes_or_times() -> None:
    device = FleetDevice.model_validate({"device_id": "d1", "online": True, "last_seen": 2.0})
    summary = RoundSummary.model_validate({"round_id": 1, "selected": 2, "participants": 2})

    assert (device.bytes_up, device.bytes_down, device.round_seconds) == (0, 0, None)
    assert summary.finished_at is None


@pytest.mark.parametrize("state", ["waiting", "stalled", "stopped"])
def test_the_new_states_round_trip_with_their_details(state: str) -> None:
    status = CoordinatorStatus(
        state=state,  # type: ignore[arg-type]
        fleet="lab",
        missing=("d2", "d7"),
        missing_count=2,
        deadline=1_700_000_000.0,
        reason="no answer for 30 s",
        events=(RunEvent(at=1.0, level="warn", text="round 3 failed"),),
    )

    assert parse_header(dump_header(status)) == status


def test_a_fleet_status_carries_bytes_and_round_time_per_device() -> None:
    row = FleetDevice(
        device_id="d1", online=True, last_seen=1.0, bytes_up=10, bytes_down=20, round_seconds=1.5
    )
    status = FleetStatus(fleet="lab", round_id=1, devices=(row,))

    assert parse_header(dump_header(status)) == status


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("missing", ["ok"] * (MAX_LISTED_MISSING + 1), "missing"),
        ("missing", ["bad/id"], "missing.0"),
        ("events", [{"at": 1.0, "text": "x"}] * (MAX_STATUS_EVENTS + 1), "events"),
        ("events", [{"at": 1.0, "level": "panic", "text": "x"}], "events.0.level"),
        ("state", "sleeping", "state"),
        ("reason", "x" * 1025, "reason"),
    ],
)
def test_bad_run_state_fields_are_refused_with_the_field_named(
    field: str, value: object, problem: str
) -> None:
    document = {
        "kind": "coordinator-status",
        "protocol_version": PROTOCOL_VERSION,
        "state": "waiting",
        "fleet": "lab",
        field: value,
    }

    with pytest.raises(ProtocolError, match=rf"malformed message: coordinator-status\.{problem}:"):
        parse_header(json.dumps(document))
