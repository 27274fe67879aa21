"""The dashboard's data: what the board makes of messages and of a run directory being written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.dashboard.board import Board
from coordinator.dashboard.feeds import RunDirectoryFeed, read_run_directory
from coordinator.dashboard.history import RunHistoryLog, flatten_settings
from coordinator.dashboard.server import Listen
from coordinator.engine.registry import FleetRegistry
from coordinator.engine.round_types import RoundRecord
from device_agent.capabilities import probe_capabilities
from protocols.codec import decode_frame, encode_frame
from protocols.messages import (
    RUN_HISTORY_ROUNDS,
    CoordinatorStatus,
    DeviceHello,
    DeviceStatus,
    EvaluationReport,
    FleetDevice,
    FleetStatus,
)

RUN_ID = "ab" * 16


def _record(round_id: int, **fields: object) -> RoundRecord:
    values: dict[str, object] = {
        "participants": 3,
        "selected": 4,
        "train_loss": 0.5,
        "bytes_up": 10,
        "bytes_down": 20,
        "wall_seconds": 0.1,
    }
    values.update(fields)
    return RoundRecord(round_id=round_id, **values)  # type: ignore[arg-type]


def _report(device_id: str, personalized: float, global_model: float | None) -> EvaluationReport:
    return EvaluationReport(
        run_id=RUN_ID,
        round_id=2,
        device_id=device_id,
        metric_name="accuracy",
        personalized=personalized,
        global_model=global_model,
        num_test_samples=10,
        num_train_samples=50,
    )


def test_the_board_merges_statuses_fleet_and_history_and_bumps_its_version() -> None:
    # Prepare
    board = Board("mqtt://127.0.0.1:1883")
    history = RunHistoryLog("default", {"task": "digits", "rounds": 3, "password": "hunter2"})
    history.add_round(_record(1, skipped=1, evaluation={"personalized_mean": 0.7, "global": 0.5}))
    history.add_evaluations([_report("dev-0000", 0.9, 0.6), _report("dev-0001", 0.4, 0.5)])
    fleet = FleetStatus(
        fleet="default",
        round_id=1,
        devices=(
            FleetDevice(
                device_id="dev-0000",
                online=True,
                last_seen=1.0,
                rounds_taken=1,
                declines=2,
                last_decline="on battery",
            ),
        ),
    )
    versions = [board.version]
    # Execute: what a broker feed hands over, as decoded frames
    for message in (
        CoordinatorStatus(state="running", fleet="default", round_id=1, rounds=3),
        fleet,
        DeviceStatus(device_id="dev-0001", state="online"),
        history.message(RUN_ID),
    ):
        decoded, _ = decode_frame(encode_frame(message))
        board.apply(decoded)
        versions.append(board.version)
    board.apply(DeviceStatus(device_id="dev-0001", state="offline", detail="connection lost"))
    snapshot = board.snapshot()
    # Assert: every message is a change; rows merge the coordinator's view and the devices' own
    assert versions == sorted(set(versions))
    assert len(versions) == 5
    assert snapshot["coordinator"]["state"] == "running"
    assert snapshot["settings"] == {"rounds": 3.0, "task": "digits"}  # never the password
    rows = {row["device"]: row for row in snapshot["fleet"]}
    assert rows["dev-0000"]["online"]
    assert rows["dev-0000"]["declines"] == 2
    assert rows["dev-0000"]["last_decline"] == "on battery"
    assert not rows["dev-0001"]["online"]  # its last-will arrived
    assert [r["round_id"] for r in snapshot["rounds"]] == [1]
    assert snapshot["rounds"][0]["skipped"] == 1
    assert [(d["device_id"], d["personalized"]) for d in snapshot["devices"]] == [
        ("dev-0000", 0.9),
        ("dev-0001", 0.4),
    ]
    json.dumps(snapshot)  # JSON-ready as it is


def test_the_snapshot_text_is_made_once_per_change_with_a_fresh_clock() -> None:
    board = Board("test")
    board.apply(DeviceStatus(device_id="dev-0000", state="online"))
    first, second = json.loads(board.snapshot_json()), json.loads(board.snapshot_json())
    assert first["fleet"] == board.snapshot()["fleet"]
    assert second["now"] >= first["now"]
    assert board._cached_version == board.version
    board.apply(DeviceStatus(device_id="dev-0000", state="offline"))
    assert not json.loads(board.snapshot_json())["fleet"][0]["online"]


def test_the_history_keeps_the_latest_rounds_and_each_devices_latest_result() -> None:
    history = RunHistoryLog("default", {})
    for round_id in range(1, RUN_HISTORY_ROUNDS + 6):
        history.add_round(_record(round_id))
    history.add_evaluations([_report("dev-0000", 0.1, 0.2)])
    history.add_evaluations([_report("dev-0000", 0.8, 0.3)])
    message = history.message(RUN_ID)
    assert len(message.rounds) == RUN_HISTORY_ROUNDS
    assert message.rounds[0].round_id == 6
    assert message.rounds[-1].round_id == RUN_HISTORY_ROUNDS + 5
    assert [(d.device_id, d.personalized) for d in message.devices] == [("dev-0000", 0.8)]
    decode_frame(encode_frame(message))  # within the wire contract's limits


def test_flattened_settings_are_scalars_without_secrets() -> None:
    flat = flatten_settings(
        {
            "task_options": {"hidden": 32, "name": "x"},
            "seeds": [0, 1, 2],
            "password": "p",
            "dashboard_token": "t",
            "lr": float("inf"),
            "out": Path("/tmp/run"),
        }
    )
    assert flat == {
        "lr": "inf",
        "out": "/tmp/run",
        "seeds": "0, 1, 2",
        "task_options.hidden": 32.0,
        "task_options.name": "x",
    }


def test_a_run_directory_in_progress_reads_without_errors(tmp_path: Path) -> None:
    # Prepare: settings, two whole metrics lines and one being appended, no summary yet
    (tmp_path / "run.json").write_text(json.dumps({"task": "digits", "rounds": 5, "fleet": "f1"}))
    lines = [json.dumps(_record(i).as_json()) for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"round_id": 3, "sel')
    (tmp_path / "devices.jsonl").write_text(
        _report("dev-0000", 0.9, 0.5).model_dump_json() + "\nnot json\n"
    )
    # Execute
    run = read_run_directory(tmp_path)
    # Assert
    assert [r.round_id for r in run["history"].rounds] == [1, 2]
    assert [d.device_id for d in run["history"].devices] == ["dev-0000"]
    assert run["coordinator"].state == "running"
    assert run["coordinator"].round_id == 2
    assert run["coordinator"].rounds == 5
    assert run["coordinator"].fleet == "f1"
    assert run["fleet"] is None
    assert not run["finished"]
    # an empty directory is an empty board, not an error
    assert read_run_directory(tmp_path / "missing")["history"].rounds == ()


def test_the_run_directory_feed_reloads_only_when_a_file_changed(tmp_path: Path) -> None:
    board = Board(str(tmp_path))
    feed = RunDirectoryFeed(board, tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_record(1).as_json()) + "\n")
    assert feed.poll()
    assert board.version == 1
    assert not feed.poll()
    assert board.version == 1
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps(_record(2).as_json()) + "\n")
    (tmp_path / "summary.json").write_text("{}")
    assert feed.poll()
    snapshot = board.snapshot()
    assert [r["round_id"] for r in snapshot["rounds"]] == [1, 2]
    assert snapshot["finished"]


def test_the_registry_counts_rounds_taken_once_and_declines_with_their_reason() -> None:
    registry = FleetRegistry()
    registry.on_hello(
        DeviceHello(
            device_id="dev-1", task="digits", num_train_samples=5, capabilities=probe_capabilities()
        )
    )
    registry.on_status(DeviceStatus(device_id="dev-1", state="training", round_id=1))
    registry.on_update("dev-1", 1, 0.5)
    registry.on_update("dev-1", 1, 0.5)  # the same round's update again (a retry)
    registry.on_update("dev-1", 2, 0.4)
    registry.on_status(DeviceStatus(device_id="dev-1", state="skipped", detail="on battery"))
    (record,) = registry.records()
    assert (record.rounds_taken, record.declines, record.last_decline) == (2, 1, "on battery")


@pytest.mark.parametrize(
    ("text", "host", "port", "loopback"),
    [
        ("127.0.0.1:8080", "127.0.0.1", 8080, True),
        (":9000", "127.0.0.1", 9000, True),
        ("9001", "127.0.0.1", 9001, True),
        ("localhost:80", "localhost", 80, True),
        ("[::1]:8080", "::1", 8080, True),
        ("0.0.0.0:8080", "0.0.0.0", 8080, False),
        ("coordinator.local:8080", "coordinator.local", 8080, False),
    ],
)
def test_listen_addresses_parse_and_know_whether_they_are_loopback(
    text: str, host: str, port: int, loopback: bool
) -> None:
    listen = Listen.parse(text)
    assert (listen.host, listen.port, listen.loopback) == (host, port, loopback)


@pytest.mark.parametrize("text", ["127.0.0.1:", "127.0.0.1:http", "host:70000", ""])
def test_a_listen_address_without_a_usable_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        Listen.parse(text)
