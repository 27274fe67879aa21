"""A round nobody selected can answer ends at once, on a real broker with declining agents."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coordinator.engine.rounds import Coordinator, EngineSettings
from coordinator.run.pipeline import build_coordinator, plan_stages
from coordinator.run.settings import SimulationSettings
from device_agent.agent import device_will
from device_agent.eligibility import EligibilityPolicy
from pfl_tasks.registry import load_task
from protocols.errors import RoundError
from protocols.transport.inprocess import InProcessBroker
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.hub_fleet import TASK, hub_agents

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(120)]
DEVICES = 3
NEVER_ENOUGH_MEMORY = EligibilityPolicy(min_free_memory_bytes=2**62)


@pytest.fixture
def fleet(mosquitto: Mosquitto) -> Iterator[Coordinator]:
    """A coordinator (deadline 60 s) and three agents over mosquitto, all of which decline."""
    task = load_task(TASK)
    model = task.build_model(0)
    settings = SimulationSettings.load(None, task=TASK, algorithm="fedavg", devices=DEVICES)
    transports = [MqttTransport(BrokerSettings(url=mosquitto.url), "coordinator")]
    coordinator = build_coordinator(
        lambda: transports[0],
        plan_stages(settings, task, model),
        model,
        EngineSettings(task=TASK, rounds=1, quorum=0.5, round_timeout_s=60.0),
    )

    def over_mqtt(index: int) -> dict[str, Any]:
        device_id = f"dev-{index}"
        will = device_will("default", device_id)
        transports.append(MqttTransport(BrokerSettings(url=mosquitto.url), device_id, will=will))
        return {"transport": transports[-1], "eligibility": NEVER_ENOUGH_MEMORY}

    try:
        coordinator.start()
        hub_agents(InProcessBroker(), [f"dev-{i}" for i in range(DEVICES)], over_mqtt)
        assert coordinator.wait_for_devices(DEVICES, 20.0)
        yield coordinator
    finally:
        for transport in transports:
            transport.close()


def test_when_every_selected_device_declines_the_round_fails_without_waiting(
    fleet: Coordinator,
) -> None:
    coordinator = fleet
    waits: list[bool] = []
    wait_until = coordinator.transport.wait_until

    def recorded(predicate: Callable[[], bool], timeout_s: float) -> bool:
        waits.append(wait_until(predicate, timeout_s))
        return waits[-1]

    coordinator.transport.wait_until = recorded  # type: ignore[method-assign]

    # Execute / Assert: it closed because nobody was left, not because the deadline passed
    with pytest.raises(RoundError, match="only 0 of 3 updates, the others declined or went"):
        coordinator.run_round()
    assert waits == [True]
    declines = {r.device_id: r.declines for r in coordinator.registry.records()}
    assert declines == {f"dev-{i}": 1 for i in range(DEVICES)}
