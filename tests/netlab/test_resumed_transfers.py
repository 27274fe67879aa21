"""A chunked transfer cut mid-chunk resumes from what arrived instead of starting over.

Real mosquitto, the device's connection through the fault proxy: a model download (retained,
as the coordinator publishes it) and an update upload are cut once mid-chunk; each completes
intact, and the bytes through the proxy stay well under what a restart would cost (the bytes
before the cut plus the whole payload again).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.netlab.profiles import Link
from tests.netlab.proxy import FaultProxy

pytestmark = pytest.mark.mosquitto

CHUNK = 64 * 1024
PAYLOAD = 2_000_000
CUT_AT = 1_200_000  # mid-chunk: 1,200,000 is not a multiple of the chunk's wire size
# A link slow enough that chunks are received and acknowledged as they come, not buffered
# whole in the sockets, so the cut falls in the middle of a transfer under way.
LINK = Link("2-MB/s", up_bps=2_000_000, down_bps=2_000_000)


def _settings(url: str, protocol: str) -> BrokerSettings:
    return BrokerSettings(
        url=url,
        protocol="5" if protocol == "5" else "3.1.1",
        chunk_size_bytes=CHUNK,
        reconnect_min_delay_s=0.1,
        reconnect_max_delay_s=0.5,
    )


@pytest.fixture
def proxy(mosquitto: Mosquitto) -> Iterator[FaultProxy]:
    with FaultProxy(mosquitto.port, LINK) as running:
        yield running


@pytest.fixture(params=["3.1.1", "5"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _restart_cost() -> int:
    return CUT_AT + PAYLOAD


def _resumed_ceiling() -> int:
    """The payload, plus at most a few chunks sent twice (the one cut, ones not yet acked)."""
    return PAYLOAD + 4 * CHUNK


def test_model_download_cut_mid_chunk_resumes(
    mosquitto: Mosquitto, proxy: FaultProxy, protocol: str
) -> None:
    payload = os.urandom(PAYLOAD)
    received: list[bytes] = []
    with MqttTransport(_settings(mosquitto.url, protocol), "coordinator") as coordinator:
        coordinator.publish("pfl/f/model", payload, retain=True)
        assert coordinator.flush(30)
        with MqttTransport(_settings(proxy.url, protocol), "device") as device:
            proxy.cut_after("down", CUT_AT)
            device.subscribe("pfl/f/model", lambda _topic, data: received.append(data))

            assert device.wait_until(lambda: bool(received), 120)
            device.unsubscribe("pfl/f/model")  # as the agent does once its model arrived
            assert proxy.wait_quiet(1.0, 120)
            assert not proxy.cut_pending
            assert proxy.resets == 1

    assert received == [payload]
    assert proxy.bytes_down < _resumed_ceiling() < _restart_cost()


def test_update_upload_cut_mid_chunk_resumes(
    mosquitto: Mosquitto, proxy: FaultProxy, protocol: str
) -> None:
    payload = os.urandom(PAYLOAD)
    received: list[bytes] = []
    with MqttTransport(_settings(mosquitto.url, protocol), "coordinator") as coordinator:
        coordinator.subscribe("pfl/f/device/d1/update", lambda _topic, data: received.append(data))
        with MqttTransport(_settings(proxy.url, protocol), "device") as device:
            proxy.cut_after("up", CUT_AT)
            device.publish("pfl/f/device/d1/update", payload)

            assert coordinator.wait_until(lambda: bool(received), 120)
            assert device.flush(60)
            assert proxy.wait_quiet(1.0, 120)
            assert proxy.resets == 1

    assert received == [payload]
    assert proxy.bytes_up < _resumed_ceiling() < _restart_cost()
