"""Issue 5 end to end: export over MQTT, offline from a state dir, after a simulation, refusals."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
import paho.mqtt.client as paho
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion
from typer.testing import CliRunner

from coordinator.cli.app import app as coord_app
from coordinator.run.serve import run_serve
from device_agent.agent import DeviceAgent
from device_agent.state_store import DiskStateStore
from export import read_metadata
from pfl_tasks.base import PartitionSpec
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.algorithms import ALGORITHM_CONFIGS
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import (
    Command,
    DeviceAssignment,
    ExportArguments,
    ExportReport,
    RoundAnnouncement,
)
from protocols.messages import SharedModel as SharedModelMessage
from protocols.transport.inprocess import InProcessBroker
from tests.e2e.conftest import export_offline, export_over_mqtt, serve_settings
from tests.wiretap import decoded_into

pytestmark = [pytest.mark.timeout(900)]
FLEET = "default"


class Wiretap:
    """Every message published on the broker, recorded by a plain paho client on `#`."""

    def __init__(self, port: int) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._client = paho.Client(CallbackAPIVersion.VERSION2, client_id="export-wiretap")
        self._client.on_message = self._record
        self._client.connect("127.0.0.1", port)
        self._client.subscribe("#", qos=1)
        self._client.loop_start()

    def _record(self, _client: object, _userdata: object, message: paho.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((message.topic, bytes(message.payload)))

    def stop(self) -> list[tuple[str, bytes]]:
        self._client.loop_stop()
        self._client.disconnect()
        with self._lock:
            return list(self.messages)


def _check_onnx(path: Path, device_id: str, algorithm: str) -> None:
    """The file loads in onnxruntime, answers a batch of digits and names its device."""
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: np.zeros((3, 64), np.float32)})
    assert output.shape == (3, 10)
    metadata = read_metadata(path)
    assert metadata["pfl.device_id"] == device_id
    assert metadata["pfl.algorithm"] == algorithm


@pytest.mark.mosquitto
def test_export_over_mqtt_then_offline_from_the_state_dir(mosquitto, processes, tmp_path) -> None:
    # Prepare: a short served fedavg-ft run with two agent processes, a wiretap on `#`
    tap = Wiretap(mosquitto.port)
    processes.fleet(mosquitto.url, 2)
    run_serve(
        serve_settings(
            mosquitto.url, tmp_path, task="digits", algorithm="fedavg-ft", rounds=2, min_devices=2
        )
    )
    out_dir = tmp_path / "exports"
    # Execute: `pfl-coord export` as a process
    exported = export_over_mqtt(mosquitto.url, out_dir, tmp_path)
    wire = tap.stop()
    # Assert: two ok reports, verified files that name their device
    assert exported.returncode == 0, exported.stdout + exported.stderr
    result = json.loads(exported.stdout)
    assert result["ok"] is True
    assert result["missing"] == []
    rows = {row["device"]: row for row in result["devices"]}
    assert sorted(rows) == ["dev-0000", "dev-0001"]
    for device_id, row in rows.items():
        path = out_dir / f"{device_id}.onnx"
        assert row["ok"] is True
        assert row["path"] == str(path)
        assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert row["size_bytes"] == path.stat().st_size
        assert row["parity_max_abs_diff"] <= 1e-4
        assert row["chosen"] == "personalized"
        assert 0.0 < row["metric"] <= 1.0
        _check_onnx(path, device_id, "fedavg-ft")
    # Assert: the command went to every device; the reports were small frames without tensors
    assert any(t == topics.command(FLEET) for t, _ in wire)
    reports = [payload for t, payload in wire if t.endswith("/export-report")]
    assert len(reports) == 2
    for payload in reports:
        message, blob = decode_frame(payload)
        assert isinstance(message, ExportReport)
        assert blob == b""
        assert len(payload) < 2048
    # Execute: the agents stop; `pfl-agent export` works offline from dev-0000's state dir
    processes.stop_all()
    offline_path = tmp_path / "offline" / "model.onnx"
    offline = export_offline(tmp_path, "dev-0000", offline_path, task="digits", shard=0, shards=2)
    # Assert: the same model the running agent exported, bit for bit
    assert offline.returncode == 0, offline.stdout + offline.stderr
    report = ExportReport.model_validate_json(offline.stdout)
    assert report.ok
    assert report.device_id == "dev-0000"  # recorded by the agent, not given
    assert report.round_id == 2
    _check_onnx(offline_path, "dev-0000", "fedavg-ft")
    assert report.sha256 == rows["dev-0000"]["sha256"]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread, as the agent processes run: busy CI machines starve spinning workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_CONFIGS))
@pytest.mark.usefixtures("one_thread")
def test_simulate_exports_one_verified_file_per_device(algorithm, tmp_path) -> None:
    # Execute
    export_dir = tmp_path / "models"
    outcome = CliRunner().invoke(
        coord_app,
        ["simulate", "--task", "digits", "--algorithm", algorithm, "--devices", "3",
         "--rounds", "2", "--out", str(tmp_path / "run"), "--export-dir", str(export_dir)],
    )  # fmt: skip
    # Assert
    assert outcome.exit_code == 0, outcome.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    export = summary["export"]
    files = sorted(export_dir.glob("*.onnx"))
    assert (export["ok"], export["failed"]) == (3, 0)
    assert export["total_bytes"] == sum(f.stat().st_size for f in files)
    assert [f.name for f in files] == ["dev-0000.onnx", "dev-0001.onnx", "dev-0002.onnx"]
    for path in files:
        _check_onnx(path, path.stem, algorithm)
        assert read_metadata(path)["pfl.round"] == "2"


def test_an_agent_with_state_for_another_architecture_refuses_clearly(tmp_path) -> None:
    # Prepare: an agent on an in-process hub whose state dir holds personal state of another
    # shape; a coordinator client that announces a fedalt round addressed to someone else
    task = load_task("digits")
    workspace = task.build_model(0)
    initial = {k: v.detach().clone() for k, v in workspace.state_dict().items()}
    run_id = "5" * 32  # the state is this run's: another run's would be set aside, not refused
    DiskStateStore(tmp_path / "state").save("0" * 64, {"output.weight": torch.zeros(5, 3)}, run_id)
    hub = InProcessBroker()
    agent = DeviceAgent(
        device_id="old-pi",
        fleet=FLEET,
        transport=hub.connect("old-pi"),
        task=task,
        data=task.make_fleet(2, PartitionSpec(scheme="iid"), 0)[0],
        seed=0,
        store=DiskStateStore(tmp_path / "state"),
        workspace=workspace,
        initial_state=initial,
    )
    coordinator = hub.connect("coordinator")
    reports: list[ExportReport] = []
    coordinator.subscribe(
        topics.device(FLEET, "old-pi", "export-report"),
        decoded_into(ExportReport, reports),
    )
    agent.start()
    arguments = ExportArguments(out_dir=str(tmp_path / "out"))
    command = encode_frame(Command(action="export", export=arguments))
    # Execute: an export before any round, then after a round
    coordinator.publish(topics.command(FLEET), command)
    coordinator.wait_until(lambda: len(reports) == 1, 5.0)
    algorithm = "fedalt"
    manifest, blob = pack_tensors(initial)  # the coordinator sends the whole model
    model = encode_frame(SharedModelMessage(round_id=3, manifest=manifest), blob)
    announcement = RoundAnnouncement(
        run_id=run_id,
        round_id=3,
        phase="train",
        algorithm=algorithm,
        model_sha256=manifest.sha256,
        assignments={"someone-else": DeviceAssignment()},
    )
    coordinator.publish(topics.shared_model(FLEET), model, retain=True)
    coordinator.publish(topics.round_announcement(FLEET), encode_frame(announcement), retain=True)
    coordinator.publish(topics.command(FLEET), command)
    coordinator.wait_until(lambda: len(reports) == 2, 30.0)
    # Assert
    before, after = reports
    assert not before.ok
    assert "no round seen yet" in before.error
    assert not after.ok
    assert after.round_id == 3
    assert "made for another task, architecture or split" in after.error
    assert "pfl-agent reset-state" in after.error
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "state" / "shared-model.frame").exists()  # kept for offline export


@pytest.mark.usefixtures("one_thread")
def test_simulate_exports_with_int8_and_the_guard(tmp_path) -> None:
    # Execute: the fleet export's options, from a simulation
    export_dir = tmp_path / "models"
    outcome = CliRunner().invoke(
        coord_app,
        ["simulate", "--task", "digits", "--algorithm", "fedalt", "--devices", "3",
         "--rounds", "2", "--out", str(tmp_path / "run"), "--export-dir", str(export_dir),
         "--export-quantize", "int8", "--export-guard"],
    )  # fmt: skip
    # Assert: an fp32 and an int8 file per device, and the guard's decisions counted
    assert outcome.exit_code == 0, outcome.output
    export = json.loads((tmp_path / "run" / "summary.json").read_text())["export"]
    assert (export["ok"], export["failed"]) == (3, 0)
    assert 0 <= export["shipped_global"] <= 3
    for index in range(3):
        fp32 = export_dir / f"dev-{index:04d}.onnx"
        int8 = export_dir / f"dev-{index:04d}.int8.onnx"
        assert read_metadata(int8)["pfl.quantization"] == "int8"
        assert read_metadata(fp32)["pfl.chosen_model"] in ("personalized", "global")
