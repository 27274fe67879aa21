"""What crosses the broker: crafted duplicates and stale updates, a wiretap, a 10M model."""

from __future__ import annotations

import threading
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion
from safetensors.torch import load_file

from coordinator.engine.rounds import Coordinator, EngineSettings, coordinator_will
from coordinator.run.serve import run_serve
from coordinator.strategies import build_strategy
from device_agent.capabilities import probe_capabilities
from pfl_tasks.registry import load_task
from protocols import topics
from protocols.algorithms import parse_algorithm_config
from protocols.codec import decode_frame, encode_frame, pack_tensors
from protocols.messages import DeviceHello, DeviceStatus, DeviceUpdate, RoundAnnouncement
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.e2e.conftest import serve_settings

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(90)]
FLEET = "default"


def test_duplicated_and_stale_updates_change_nothing(mosquitto) -> None:
    # Prepare: a coordinator, and a crafted device answering each round with +0.01,
    # sending it twice and, before it, a stale update of +100 for the previous round
    task = load_task("digits")
    shared = dict(task.build_model(0).state_dict())
    broker = BrokerSettings(url=mosquitto.url)
    coordinator = Coordinator(
        MqttTransport(broker, "coord", will=coordinator_will(FLEET), clean_start=True),
        build_strategy(parse_algorithm_config("fedavg", {}), 1.0),
        shared,
        EngineSettings(fleet=FLEET, task="digits", rounds=2, round_timeout_s=20.0),
    )
    device = MqttTransport(broker, "crafted", clean_start=True)

    def update(round_id: int, delta: float) -> bytes:
        manifest, blob = pack_tensors({k: torch.full_like(v, delta) for k, v in shared.items()})
        message = DeviceUpdate(
            run_id=coordinator.run_id,
            round_id=round_id,
            device_id="crafted",
            algorithm="fedavg",
            num_samples=10,
            train_loss=1.0,
            manifest=manifest,
        )
        return encode_frame(message, blob)

    def on_round(_topic: str, payload: bytes) -> None:
        announcement, _ = decode_frame(payload)
        if not isinstance(announcement, RoundAnnouncement) or announcement.phase != "train":
            return
        topic = topics.device(FLEET, "crafted", "update")
        device.publish(topic, update(announcement.round_id - 1, 100.0))
        device.publish(topic, update(announcement.round_id, 0.01))
        device.publish(topic, update(announcement.round_id, 0.01))
        device.publish(topic, update(announcement.round_id, 50.0))  # same round, later: ignored

    device.subscribe(topics.round_announcement(FLEET), on_round)
    coordinator.start()
    device.publish(
        topics.device(FLEET, "crafted", "status"),
        encode_frame(DeviceStatus(device_id="crafted", state="online")),
    )
    hello = DeviceHello(
        device_id="crafted", task="digits", num_train_samples=10, capabilities=probe_capabilities()
    )
    device.publish(topics.device(FLEET, "crafted", "hello"), encode_frame(hello))
    assert coordinator.wait_for_devices(1, 10.0)
    # Execute
    records = [coordinator.run_round(), coordinator.run_round()]
    device.flush(5.0)
    coordinator.transport.wait_until(lambda: coordinator.rejected >= 2, 5.0)
    # Assert: exactly two applications of +0.01
    assert [r.participants for r in records] == [1, 1]
    for name, tensor in shared.items():
        assert torch.allclose(coordinator.shared[name], tensor + 0.02, atol=1e-6), name
    assert coordinator.rejected >= 2  # the stale round-0 and round-1 updates
    device.close()
    coordinator.transport.close()


def test_a_wiretap_sees_no_personal_parameter(mosquitto, processes, tmp_path) -> None:
    # Prepare: record every byte published on the broker
    payloads: list[bytes] = []
    lock = threading.Lock()
    tap = paho.Client(CallbackAPIVersion.VERSION2, client_id="wiretap")

    def record(_c: object, _u: object, message: paho.MQTTMessage) -> None:
        with lock:
            payloads.append(message.topic.encode() + b"\n" + message.payload)
            if "/device/" in message.topic:
                uplink.append(message.payload)

    uplink: list[bytes | bytearray] = []
    tap.on_message = record
    tap.connect("127.0.0.1", mosquitto.port)
    tap.subscribe("#", qos=1)
    tap.loop_start()
    processes.fleet(mosquitto.url, 2)
    settings = serve_settings(
        mosquitto.url,
        tmp_path,
        task="digits",
        algorithm="fedavg",
        personal=["output.*"],
        rounds=2,
        min_devices=2,
        round_timeout=20.0,
    )
    # Execute
    result = run_serve(settings)
    processes.stop_all()
    tap.loop_stop()
    tap.disconnect()
    # Assert
    wire = b"".join(payloads)
    sent_by_devices = b"".join(uplink)
    assert b"hidden.weight" in sent_by_devices  # the tap did see shared deltas go up
    # Devices never name a personal tensor; the coordinator's broadcast carries only the global
    # starting point of the personal part (spec partial-personalization.md §3.3), not a device's.
    assert b"output." not in sent_by_devices
    assert not any(name.startswith("output.") for name in result.final_shared)
    personal = [load_file(str(p)) for p in Path(tmp_path / "state").glob("*/personal.safetensors")]
    assert len(personal) == 2
    initial = task_output_bytes()
    for tensors in personal:
        for name, tensor in tensors.items():
            assert not torch.equal(tensor, initial[name]), "the device trained its personal part"
            raw = tensor.contiguous().numpy().tobytes()
            assert raw[:64] not in wire, name


def task_output_bytes() -> dict[str, torch.Tensor]:
    """The personal tensors every device starts from."""
    state = load_task("digits").build_model(0).state_dict()
    return {name: value for name, value in state.items() if name.startswith("output.")}


def test_a_10m_parameter_model_crosses_in_chunks_both_ways(mosquitto, processes, tmp_path) -> None:
    # Prepare
    task_name = "pfl_test_tasks:BigDigitsTask"
    processes.agent(mosquitto.url, 0, shards=1, task=task_name)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        initial = dict(load_task(task_name).build_model(0).state_dict())
        settings = serve_settings(
            mosquitto.url,
            tmp_path,
            task=task_name,
            algorithm="fedavg",
            personal=[],
            rounds=1,
            min_devices=1,
            round_timeout=60.0,
        )
        # Execute
        result = run_serve(settings)
    finally:
        sys.path.remove(str(Path(__file__).resolve().parent))
    # Assert
    parameters = sum(t.numel() for t in result.final_shared.values())
    assert parameters > 10_000_000
    assert result.records[0].participants == 1
    assert result.records[0].bytes_up > 40_000_000
    assert not torch.equal(result.final_shared["wide.weight"], initial["wide.weight"])
