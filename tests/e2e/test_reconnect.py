"""An agent process outlives a broker restart and announces itself again."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from coordinator.engine.rounds import RoundRecord
from coordinator.run.pipeline import RunResult
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols import topics
from protocols.codec import decode_frame
from protocols.messages import DeviceStatus
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]


def _retained_status(url: str, device_id: str) -> DeviceStatus | None:
    found: list[DeviceStatus] = []

    def keep(_topic: str, payload: bytes) -> None:
        message, _ = decode_frame(payload)
        if isinstance(message, DeviceStatus):
            found.append(message)

    with MqttTransport(BrokerSettings(url=url), "status-probe", clean_start=True) as probe:
        probe.subscribe(topics.device("default", device_id, "status"), keep)
        probe.wait_until(lambda: bool(found), 0.5)
    return found[-1] if found else None


def _restart_after_round_one(mosquitto: Mosquitto) -> Callable[[RoundRecord], None]:
    """An `on_round` that restarts the broker, forgetting all it held, once round 1 is in."""

    def on_round(record: RoundRecord) -> None:
        if record.round_id == 1:
            mosquitto.restart(down_s=0.5)

    return on_round


def _assert_fault_free(result: RunResult, devices: int) -> None:
    """All `devices` took part in each of 3 rounds and the model is exactly the fault-free one.

    The fault-free one is the in-process simulation of the same fleet on the per-device path,
    the one devices over MQTT train on (`--batched auto` stacks in-process devices, equal only to
    float32 rounding).
    """
    assert [(r.round_id, r.participants) for r in result.records] == [
        (1, devices),
        (2, devices),
        (3, devices),
    ]
    fault_free = run_simulation(
        SimulationSettings.load(None, devices=devices, rounds=3, batched="off")
    )
    for name, tensor in fault_free.final_shared.items():
        assert torch.equal(result.final_shared[name], tensor), name


def test_an_agent_rejoins_a_restarted_broker(mosquitto, processes) -> None:
    # Prepare: an agent whose retained "online" status the broker holds
    processes.agent(mosquitto.url, 0, shards=3)
    wait_for(lambda: _retained_status(mosquitto.url, "dev-0000") is not None, "its status")
    # Execute: the broker restarts with no persistence, forgetting every retained message
    mosquitto.restart(down_s=0.5)
    seen: list[DeviceStatus] = []

    def republished() -> bool:
        status = _retained_status(mosquitto.url, "dev-0000")
        seen.extend([] if status is None else [status])
        return bool(seen)

    wait_for(republished, "its status again, after the restart")
    # Assert: the agent reconnected and re-published its status (and its hello)
    status = seen[-1]
    assert status.state == "online"
    assert processes.running["dev-0000"].poll() is None


def test_a_run_survives_a_broker_restart_between_rounds(mosquitto, processes, tmp_path) -> None:
    # Prepare
    processes.fleet(mosquitto.url, 2)
    settings = ServeSettings.load(
        None,
        broker=mosquitto.url,
        rounds=3,
        min_devices=2,
        round_timeout=30.0,
        checkpoint_dir=tmp_path / "checkpoint",
    )

    # Execute
    result = run_serve(settings, on_round=_restart_after_round_one(mosquitto))
    # Assert: every round had both devices, none was lost to the restart, and the result is
    # exactly the fault-free one
    _assert_fault_free(result, devices=2)


def test_a_simulation_over_mqtt_survives_a_broker_restart_between_rounds(
    mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: virtual devices, each a real MQTT client of the same broker as the coordinator
    settings = SimulationSettings.load(
        None, devices=3, rounds=3, transport="mqtt", broker=mosquitto.url
    )

    # Execute
    result = run_simulation(settings, on_round=_restart_after_round_one(mosquitto))
    # Assert: every device said hello again and took part in every round, the model is the
    # fault-free one, and one restart is no flapping
    _assert_fault_free(result, devices=3)
    assert not [r for r in caplog.records if "two devices probably run" in r.getMessage()]
