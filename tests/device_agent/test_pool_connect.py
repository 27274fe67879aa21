"""Tests for a pool's connections: a late CONNACK for one device does not stop the pool."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import device_agent.pool as pool_module
from device_agent.pool import run_pool
from device_agent.settings import PoolSettings
from protocols.transport.base import Transport
from protocols.transport.factory import connect as real_connect
from protocols.transport.mqtt import BrokerConnectionError
from tests.conftest import Mosquitto


def test_a_device_whose_first_connect_times_out_is_retried(
    mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: every device's first connect fails as an overloaded broker's late CONNACK does
    attempts: dict[str, int] = {}
    ready = threading.Event()

    def flaky_connect(broker: Any, device_id: str, *args: Any, **kwargs: Any) -> Transport:
        attempts[device_id] = attempts.get(device_id, 0) + 1
        if attempts[device_id] == 1:
            msg = "no CONNACK within 10.0 s"
            raise BrokerConnectionError(msg)
        transport: Transport = real_connect(broker, device_id, *args, **kwargs)
        if len(attempts) == 3:
            ready.set()
        return transport

    monkeypatch.setattr(pool_module, "connect", flaky_connect)
    settings = PoolSettings(devices="0-2", num_shards=3, task="synthetic", broker=mosquitto.url)
    stop = threading.Event()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            run_pool(settings, stop)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)
            ready.set()

    # Act
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(120)
    stop.set()
    thread.join(120)
    # Assert: each device connected on its second try and the pool ran
    assert errors == []
    assert attempts == {"dev-0000": 2, "dev-0001": 2, "dev-0002": 2}


def test_a_pool_larger_than_its_clients_can_poll_is_refused_before_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Arrange: connecting would be an error here
    def no_connect(*args: Any, **kwargs: Any) -> Transport:
        msg = "connected"
        raise AssertionError(msg)

    monkeypatch.setattr(pool_module, "connect", no_connect)
    devices = pool_module.MAX_POOL_DEVICES + 1
    settings = PoolSettings(devices=f"0-{devices - 1}", num_shards=devices, task="synthetic")
    # Act / Assert
    with pytest.raises(ValueError, match="at most 300 devices"):
        run_pool(settings)
