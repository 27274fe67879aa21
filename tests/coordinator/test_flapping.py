"""An id rejoining often, or running twice at once, is named once and forgotten when it settles."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine.flapping import FlapWatch
from coordinator.engine.registry import FleetRegistry
from device_agent.capabilities import probe_capabilities
from protocols.messages import DeviceHello, DeviceStatus


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


def test_one_reconnects_burst_of_hellos_is_one_rejoin_and_alternating_instances_are_not() -> None:
    now = [0.0]
    watch = FlapWatch(threshold=3, window_s=30.0, clock=lambda: now[0], burst_s=5.0)
    # a broker restart: the agent's own hook, its answer to the coordinator's hello command and
    # to its will, all within a second
    for moment in (0.0, 0.3, 0.9, 1.5):
        now[0] = moment
        assert not watch.note("dev-1", instance="aa01")
    assert watch.flapping() == frozenset()
    # two instances taking the session from each other every second count every time
    for moment, instance in ((10.0, "aa02"), (11.0, "bb02"), (12.0, "aa02")):
        now[0] = moment
        watch.note("dev-2", instance=instance)
    assert watch.flapping() == {"dev-2"}
    # one instance whose connection keeps dropping, hellos beyond the burst apart, still flaps
    for moment in (20.0, 26.0, 32.0):
        now[0] = moment
        watch.note("dev-3", instance="cc03")
    assert watch.flapping() == {"dev-2", "dev-3"}


def test_a_second_running_instance_flaps_at_once_and_a_restart_after_its_will_does_not() -> None:
    # Prepare: what a broker that never knocks the older connection off shows the coordinator
    now = [0.0]
    watch = FlapWatch(threshold=3, window_s=30.0, clock=lambda: now[0])
    registry = FleetRegistry()

    def hello(device_id: str, instance: str) -> bool:
        clash = registry.on_hello(_hello(device_id, instance))
        watch.note(device_id, clash)
        return clash

    # Execute / Assert: two instances of dev-1 online together
    assert not hello("dev-1", "aa01")
    assert hello("dev-1", "bb02")
    assert watch.flapping() == {"dev-1"}
    assert not hello("dev-1", "bb02")  # the same instance saying hello again is no clash
    now[0] = 40.0
    assert watch.flapping() == frozenset()  # forgotten when it settles
    # a device that restarts after its will (offline) was published is no clash
    assert not hello("dev-2", "cc03")
    registry.on_status(DeviceStatus(device_id="dev-2", state="offline"))
    assert not hello("dev-2", "dd04")
    assert watch.flapping() == frozenset()
    # agents of older versions send no token: never a clash
    assert not hello("dev-3", "")
    assert not hello("dev-3", "ee05")


def _hello(device_id: str, instance: str) -> DeviceHello:
    return DeviceHello(
        device_id=device_id,
        task="digits",
        num_train_samples=10,
        capabilities=probe_capabilities(),
        instance=instance,
    )
