"""MQTT 5 message expiry on real mosquitto: a stale call for work is neither queued nor retained."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from protocols.transport.base import publish_expiring
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.wiretap import Inbox

pytestmark = pytest.mark.mosquitto

EXPIRY_S = 1
PAST_EXPIRY_S = 2.5
CALL, LASTING = "pfl/f/round", "pfl/f/coordinator/status"


@pytest.fixture
def opened() -> Iterator[list[MqttTransport]]:
    transports: list[MqttTransport] = []
    yield transports
    for transport in transports:
        transport.close()


def client(
    broker: Mosquitto, client_id: str, protocol: Literal["3.1.1", "5"], into: list[Any], **kw: Any
) -> MqttTransport:
    settings = BrokerSettings(url=broker.url, protocol=protocol, connect_timeout_s=5)
    transport = MqttTransport(settings, client_id, **kw)
    into.append(transport)
    return transport


@pytest.mark.parametrize(
    ("protocol", "delivered"), [("5", [b"kept"]), ("3.1.1", [b"stale", b"kept"])]
)
def test_a_device_away_past_the_expiry_is_not_sent_the_expired_message(
    mosquitto: Mosquitto,
    opened: list[MqttTransport],
    protocol: Literal["3.1.1", "5"],
    delivered: list[bytes],
) -> None:
    # Arrange: a device with a kept session subscribes, then its connection drops
    coordinator = client(mosquitto, "exp-coordinator", protocol, opened)
    device = MqttTransport(BrokerSettings(url=mosquitto.url, protocol=protocol), "exp-device")
    device.subscribe(CALL, Inbox())
    device.abort()

    # Act: while it is away, an expiring call for work and a plain message are queued for it
    publish_expiring(coordinator, CALL, b"stale", expiry_s=EXPIRY_S)
    coordinator.publish(CALL, b"kept")
    assert coordinator.flush(5)
    time.sleep(PAST_EXPIRY_S)
    inbox = Inbox()
    back = client(mosquitto, "exp-device", protocol, opened)
    back.subscribe(CALL, inbox)

    # Assert: under MQTT 5 the broker dropped the expired one; 3.1.1 has no expiry
    assert back.wait_until(inbox.has(len(delivered)), timeout_s=10)
    back.wait_until(lambda: False, 0.5)  # nothing else may follow
    assert sorted(inbox.payloads()) == sorted(delivered)


def test_an_expired_retained_message_is_gone_and_a_fresh_one_is_not(
    mosquitto: Mosquitto, opened: list[MqttTransport]
) -> None:
    # Arrange
    coordinator = client(mosquitto, "ret-coordinator", "5", opened)
    publish_expiring(coordinator, CALL, b"round 1", retain=True, expiry_s=EXPIRY_S)
    coordinator.publish(LASTING, b"running", retain=True)
    assert coordinator.flush(5)
    early = Inbox()
    client(mosquitto, "ret-early", "5", opened).subscribe(CALL, early)
    assert opened[-1].wait_until(early.has(1), timeout_s=5)  # before its expiry it is retained

    # Act
    time.sleep(PAST_EXPIRY_S)
    late = Inbox()
    device = client(mosquitto, "ret-late", "5", opened)
    device.subscribe(CALL, late)
    device.subscribe(LASTING, late)

    # Assert: only the message without expiry is still retained
    assert device.wait_until(late.has(1), timeout_s=5)
    device.wait_until(lambda: False, 0.5)
    assert early.payloads() == [b"round 1"]
    assert late.messages == [(LASTING, b"running")]
