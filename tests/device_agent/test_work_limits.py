"""A device's own ceilings on one round's work: declined up front, or stopped while running."""

from __future__ import annotations

from typing import Any

import pytest

from device_agent.work_limits import WorkLimitError, WorkLimits, WorkMeter, config_problem
from protocols import topics
from protocols.messages import DeviceStatus
from protocols.transport.inprocess import InProcessBroker
from tests.hub_fleet import hub_agents, hub_coordinator
from tests.wiretap import decoded_into


def test_settings_above_the_ceilings_are_named() -> None:
    limits = WorkLimits(max_epochs=5, max_steps=50)
    within = {"local_epochs": 5, "prox_steps": 50, "adaptive_steps": True}
    assert config_problem(within, limits) is None
    assert "local_epochs=6" in str(config_problem({"local_epochs": 6}, limits))
    assert "finetune_epochs=1000000" in str(config_problem({"finetune_epochs": 10**6}, limits))
    assert "prox_steps=51" in str(config_problem({"prox_steps": 51, "lr": 0.1}, limits))
    assert config_problem({"max_steps": None, "personal": ["a"]}, limits) is None


def test_the_meter_stops_a_round_past_its_steps_or_seconds() -> None:
    now = [0.0]
    meter = WorkMeter(WorkLimits(max_steps=3, max_seconds=10.0), clock=lambda: now[0])
    for _ in range(3):
        meter.tick()
    with pytest.raises(WorkLimitError, match="ceiling of 3 steps"):
        meter.tick()
    slow = WorkMeter(WorkLimits(max_steps=100, max_seconds=10.0), clock=lambda: now[0])
    slow.tick()
    now[0] = 10.5
    with pytest.raises(WorkLimitError, match="ceiling of 10 s"):
        slow.tick()


def _run_one_round(limits: WorkLimits, options: dict[str, Any]) -> tuple[int, str]:
    """A round with a limited device and an unlimited one: (participants, limited's detail)."""
    broker = InProcessBroker()
    coordinator = hub_coordinator(broker, "fedavg", 2, 1, **options)
    hub_agents(broker, ["limited", "free"], lambda index: {"limits": (limits, None)[index]})
    statuses: list[DeviceStatus] = []
    watcher = broker.connect("watcher")
    watcher.subscribe(
        topics.device("default", "limited", "status"),
        decoded_into(DeviceStatus, statuses),
    )
    coordinator.start()
    assert coordinator.wait_for_devices(2, 1.0)
    record = coordinator.run_round()
    broker.pump(lambda: False)
    return record.participants, statuses[-1].detail if statuses else ""


def test_a_round_asking_for_too_many_epochs_is_declined_with_the_reason() -> None:
    participants, detail = _run_one_round(WorkLimits(max_epochs=5), {"local_epochs": 6})
    assert participants == 1
    assert "local_epochs=6 is above this device's ceiling of 5 epochs" in detail


def test_a_round_running_past_the_step_ceiling_is_stopped_and_declined() -> None:
    participants, detail = _run_one_round(WorkLimits(max_steps=3), {"local_epochs": 2})
    assert participants == 1
    assert "passed this device's ceiling of 3 steps" in detail


def test_within_the_ceilings_nothing_changes() -> None:
    participants, detail = _run_one_round(WorkLimits(), {"local_epochs": 2})
    assert participants == 2
    assert "ceiling" not in detail
