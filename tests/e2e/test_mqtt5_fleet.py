"""A fleet on MQTT 5: the run is the simulation's, and each round's call for work expires."""

from __future__ import annotations

import sys
import threading

import paho.mqtt.client as paho
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.engine.round_types import announcement_expiry
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols import topics
from protocols.codec import decode_frame
from protocols.messages import RoundAnnouncement
from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(180)]

RUN = {"task": "synthetic", "algorithm": "fedavg", "rounds": 2, "seed": 4}
FLEET = 4
DEADLINE_S = 60.0


class Calls:
    """Every round announcement the broker delivers, with its MQTT 5 message expiry."""

    def __init__(self, port: int) -> None:
        self.seen: list[tuple[str, int, bool, int | None]] = []
        self._lock = threading.Lock()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id="calls-watch", protocol=paho.MQTTv5
        )
        self.client.on_message = self._take
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(topics.round_announcement("default"), qos=1)
        self.client.loop_start()

    def _take(self, _client: object, _data: object, message: paho.MQTTMessage) -> None:
        announcement, _ = decode_frame(bytes(message.payload))
        assert isinstance(announcement, RoundAnnouncement)
        expiry = getattr(message.properties, "MessageExpiryInterval", None)
        with self._lock:
            self.seen.append(
                (announcement.phase, announcement.round_id, announcement.final, expiry)
            )

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_serve_and_a_pool_on_mqtt5_equal_the_simulation_and_calls_expire(
    mosquitto: Mosquitto, processes: Processes, tmp_path
) -> None:
    # Prepare: one pool of every device, speaking MQTT 5, and a watcher of the calls for work
    processes.start(
        "pool",
        [
            sys.executable, "-m", "device_agent.cli", "pool", "--broker", mosquitto.url,
            "--devices", f"0-{FLEET - 1}", "--num-shards", str(FLEET), "--task", "synthetic",
            "--seed", "4", "--mqtt-version", "5",
        ],
    )  # fmt: skip
    calls = Calls(mosquitto.port)
    settings = ServeSettings.load(
        None,
        **RUN,
        broker=mosquitto.url,
        mqtt_version="5",
        min_devices=FLEET,
        join_timeout=90.0,
        round_timeout=DEADLINE_S,
        checkpoint_dir=tmp_path / "checkpoint",
        out=tmp_path / "serve",
    )
    # Execute
    try:
        served = run_serve(settings)
    finally:
        calls.close()
    simulated = run_simulation(
        SimulationSettings.load(None, **RUN, devices=FLEET, workers=1, batched="off")
    )
    # Assert: the same bits as in process
    assert [r.participants for r in served.records] == [FLEET, FLEET]
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
    # each training call expires twice the deadline after it went out, the final one never
    lifetime = announcement_expiry(DEADLINE_S)
    trains = [c for c in calls.seen if c[0] == "train"]
    assert [c[1] for c in trains] == [1, 2]
    assert all(c[3] is not None and 0 < c[3] <= lifetime for c in trains), calls.seen
    finals = [c for c in calls.seen if c[2]]
    assert finals, calls.seen
    assert all(c[3] is None for c in finals), calls.seen


def test_the_embedded_broker_refuses_mqtt5_with_the_reason(tmp_path) -> None:
    settings = ServeSettings.load(
        None, **RUN, mqtt_version="5", out=tmp_path / "serve", checkpoint_dir=tmp_path / "c"
    )
    with pytest.raises(ValueError, match=r"embedded broker speaks MQTT 3\.1\.1 only"):
        run_serve(settings)
