"""MqttTransport on real loopback brokers: delivery, retained, wills, failures, reconnects."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from protocols.errors import ProtocolError
from protocols.transport.base import Will
from protocols.transport.broker import EmbeddedBroker, free_port
from protocols.transport.mqtt import BrokerConnectionError, MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.wiretap import Inbox

Connect = Callable[..., MqttTransport]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """Open transports that are closed (or already aborted) after the test."""
    opened: list[MqttTransport] = []

    def open_transport(url: str, client_id: str, **options: Any) -> MqttTransport:
        settings_fields = {
            k: options.pop(k) for k in list(options) if k in BrokerSettings.model_fields
        }
        settings = BrokerSettings(url=url, connect_timeout_s=5, **settings_fields)
        transport = MqttTransport(settings, client_id, **options)
        opened.append(transport)
        return transport

    yield open_transport
    for transport in opened:
        transport.close()


def test_publish_subscribe_round_trip(broker_url: str, connect: Connect) -> None:
    # Prepare
    inbox = Inbox()
    coordinator = connect(broker_url, "rt-coordinator")
    device = connect(broker_url, "rt-device")
    coordinator.subscribe("pfl/f/device/+/update", inbox)

    # Execute
    device.publish("pfl/f/device/d1/update", b"delta")
    device.publish("pfl/f/device/d1/hello", b"not subscribed")
    arrived = coordinator.wait_until(inbox.has(1), timeout_s=5)

    # Assert
    assert arrived
    assert inbox.messages == [("pfl/f/device/d1/update", b"delta")]
    assert device.stats.bytes_sent == len(b"delta") + len(b"not subscribed")
    assert device.stats.messages_sent == 2
    assert coordinator.stats.bytes_received == len(b"delta")
    assert coordinator.stats.messages_received == 1


@pytest.mark.mosquitto
def test_mqtt5_round_trip(mosquitto: Any, connect: Connect) -> None:
    inbox = Inbox()
    subscriber = connect(mosquitto.url, "v5-sub", protocol="5")
    publisher = connect(mosquitto.url, "v5-pub", protocol="5")
    subscriber.subscribe("pfl/f/round", inbox)

    publisher.publish("pfl/f/round", b"round 1")

    assert subscriber.wait_until(inbox.has(1), timeout_s=5)
    assert inbox.payloads() == [b"round 1"]


def test_retained_message_reaches_a_late_subscriber(broker_url: str, connect: Connect) -> None:
    publisher = connect(broker_url, "ret-coordinator")
    publisher.publish("pfl/f/round", b"round 1", retain=True)
    publisher.publish("pfl/f/round", b"round 2", retain=True)
    assert publisher.flush(5)
    inbox = Inbox()
    late = connect(broker_url, "ret-late-device")

    late.subscribe("pfl/f/round", inbox)

    assert late.wait_until(inbox.has(1), timeout_s=5)
    time.sleep(0.2)  # nothing else may follow
    assert inbox.payloads() == [b"round 2"]


def test_will_fires_after_abort_and_not_after_close(broker_url: str, connect: Connect) -> None:
    # Prepare
    inbox = Inbox()
    watcher = connect(broker_url, "will-watcher")
    watcher.subscribe("pfl/f/device/+/status", inbox)
    polite = connect(broker_url, "will-polite", will=Will("pfl/f/device/polite/status", b"offline"))
    crashing = connect(broker_url, "will-crash", will=Will("pfl/f/device/crash/status", b"offline"))

    # Execute: the clean close goes first, so its will would arrive before the crash's
    polite.close()
    crashing.abort()
    arrived = watcher.wait_until(inbox.has(1), timeout_s=10)
    time.sleep(0.3)

    # Assert
    assert arrived
    assert inbox.messages == [("pfl/f/device/crash/status", b"offline")]


def test_a_raising_handler_does_not_stop_later_messages(broker_url: str, connect: Connect) -> None:
    inbox = Inbox()

    def explode(topic: str, payload: bytes) -> None:
        if payload == b"bad":
            message = "handler bug"
            raise RuntimeError(message)
        inbox(topic, payload)

    subscriber = connect(broker_url, "raise-sub")
    publisher = connect(broker_url, "raise-pub")
    subscriber.subscribe("pfl/f/command/+", explode)

    for payload in (b"bad", b"good 1", b"bad", b"good 2"):
        publisher.publish("pfl/f/command/d1", payload)

    assert subscriber.wait_until(inbox.has(2), timeout_s=5)
    assert inbox.payloads() == [b"good 1", b"good 2"]
    assert subscriber.stats.messages_received == 4


def test_messages_queued_while_a_device_is_away_arrive_on_return(
    broker_url: str, connect: Connect
) -> None:
    # Prepare: a device with a persistent session subscribes, then leaves
    first_run = connect(broker_url, "away-device")
    first_run.subscribe("pfl/f/command/away-device", Inbox())
    first_run.close()
    coordinator = connect(broker_url, "away-coordinator")

    # Execute
    for index in range(3):
        coordinator.publish("pfl/f/command/away-device", f"command {index}".encode())
    assert coordinator.flush(5)
    inbox = Inbox()
    second_run = connect(broker_url, "away-device")
    second_run.subscribe("pfl/f/command/away-device", inbox)

    # Assert
    assert second_run.wait_until(inbox.has(3), timeout_s=5)
    assert sorted(inbox.payloads()) == [b"command 0", b"command 1", b"command 2"]


@pytest.mark.mosquitto
def test_client_reconnects_and_resubscribes_after_a_broker_restart(
    mosquitto: Any, connect: Connect
) -> None:
    # Prepare
    fast = {"reconnect_min_delay_s": 0.2, "reconnect_max_delay_s": 0.5}
    inbox = Inbox()
    device = connect(mosquitto.url, "restart-device", **fast)
    coordinator = connect(mosquitto.url, "restart-coordinator", **fast)
    device.subscribe("pfl/f/command/+", inbox)
    coordinator.publish("pfl/f/command/d1", b"before")
    assert device.wait_until(inbox.has(1), timeout_s=5)

    # Execute: persistence is off, so the restarted broker has forgotten every subscription
    mosquitto.restart()
    assert device.wait_until(lambda: device.connected and coordinator.connected, timeout_s=10)
    deadline = time.monotonic() + 10
    while not inbox.has(2)() and time.monotonic() < deadline:
        coordinator.publish("pfl/f/command/d1", b"after")  # until the re-subscription is in
        device.wait_until(inbox.has(2), timeout_s=0.3)

    # Assert
    assert inbox.payloads()[:2] == [b"before", b"after"]


@pytest.mark.mosquitto
def test_a_broker_outage_logs_no_errors_while_the_client_retries(
    mosquitto: Any, connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    fast = {"reconnect_min_delay_s": 0.1, "reconnect_max_delay_s": 0.2}
    device = connect(mosquitto.url, "outage-device", **fast)
    caplog.set_level(logging.DEBUG, logger="protocols")

    # Execute: down long enough for several reconnect attempts
    mosquitto.restart(down_s=1.5)
    assert device.wait_until(lambda: device.connected, timeout_s=10)

    # Assert: paho's per-attempt "not connected" stays at debug; one warning says what happens
    retries = [r for r in caplog.records if "Client is not connected" in r.getMessage()]
    assert retries, "paho should have logged its retries (at debug)"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("reconnecting" in message for message in warnings)


@pytest.mark.mosquitto
def test_tls_with_a_private_ca(mosquitto_tls: tuple[Any, Path], connect: Connect) -> None:
    broker, ca_file = mosquitto_tls
    url = broker.url.replace("mqtt://", "mqtts://")
    inbox = Inbox()
    client = connect(url, "tls-device", ca_file=str(ca_file))
    client.subscribe("pfl/f/round", inbox)

    client.publish("pfl/f/round", b"encrypted")

    assert client.wait_until(inbox.has(1), timeout_s=5)
    with pytest.raises(BrokerConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        connect(url, "tls-untrusting")  # the system CAs do not know this broker


def test_unreachable_broker_fails_quickly_with_the_url() -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"

    refused = f"cannot reach the MQTT broker at {url}"
    with pytest.raises(BrokerConnectionError, match=refused) as raised:
        MqttTransport(BrokerSettings(url=url, connect_timeout_s=2), "nobody-home")

    # refused at connect, the first attempt: no wait for a CONNACK, no retry
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)


def test_mqtt5_against_the_embedded_broker_fails_with_a_hint(embedded_broker: Any) -> None:
    settings = BrokerSettings(url=embedded_broker.url, protocol="5", connect_timeout_s=1)

    with pytest.raises(BrokerConnectionError, match=r"3\.1\.1"):
        MqttTransport(settings, "v5-on-amqtt")


def test_payload_above_the_limit_is_refused_before_sending(
    broker_url: str, connect: Connect
) -> None:
    publisher = connect(broker_url, "too-big", max_payload_bytes=1000, chunk_size_bytes=1024)

    with pytest.raises(ProtocolError, match="1001 bytes exceeds max_payload_bytes"):
        publisher.publish("pfl/f/model", bytes(1001))

    assert publisher.stats.messages_sent == 0


@pytest.mark.mosquitto
def test_broker_advertised_packet_limit_gives_a_clear_error(
    mosquitto_factory: Callable[[str], Any], connect: Connect
) -> None:
    # mosquitto advertises max_packet_size to MQTT 5 clients in CONNACK
    limited = mosquitto_factory("max_packet_size 100000\n")
    publisher = connect(limited.url, "limited", protocol="5", chunk_size_bytes=1 << 20)

    with pytest.raises(ProtocolError, match="maximum packet size of 100000"):
        publisher.publish("pfl/f/model", bytes(200_000))
    publisher.publish("pfl/f/model", bytes(1000))  # the connection is still usable
    assert publisher.flush(5)


@pytest.mark.mosquitto
def test_mosquitto_message_size_limit_drops_silently_under_mqtt_311(
    mosquitto_factory: Callable[[str], Any], connect: Connect
) -> None:
    # Documents the broker's behaviour: the PUBACK comes back, the message never arrives.
    limited = mosquitto_factory("message_size_limit 100000\n")
    inbox = Inbox()
    subscriber = connect(limited.url, "limit-sub")
    publisher = connect(limited.url, "limit-pub", chunk_size_bytes=1 << 20)
    subscriber.subscribe("pfl/f/model", inbox)

    publisher.publish("pfl/f/model", bytes(200_000))
    publisher.publish("pfl/f/model", b"small")

    assert publisher.flush(5)
    assert subscriber.wait_until(inbox.has(1), timeout_s=5)
    assert inbox.payloads() == [b"small"]


def test_embedded_broker_stops_quietly_under_connected_devices(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: devices with wills still connected when the run ends, as after `serve`
    broker = EmbeddedBroker(port=free_port(), run_access=None)
    broker.start()
    inbox = Inbox()
    devices = [
        connect(broker.url, f"quiet-{i}", will=Will(f"pfl/f/status/{i}", b"gone", retain=True))
        for i in range(3)
    ]
    for device in devices:
        device.subscribe("pfl/f/#", inbox)
    coordinator = connect(broker.url, "quiet-coordinator")
    for i in range(20):
        coordinator.publish("pfl/f/round", b"last words %d" % i)
    coordinator.flush(5)
    caplog.set_level(logging.INFO)

    # Execute
    broker.stop()

    # Assert: the broker says nothing a user would read as a failure (the clients do warn)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warned if r.name.startswith("amqtt")] == []
