"""`connect()`: every scheme reaches the right transport; a bad endpoint says what is wrong."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocols.errors import ProtocolError
from protocols.transport.base import Transport, TransportWrapper, Will
from protocols.transport.factory import connect
from protocols.transport.inprocess import InProcessBroker, InProcessTransport
from protocols.transport.mqtt import BrokerConnectionError, MqttTransport
from protocols.transport.settings import BrokerSettings


@pytest.fixture
def opened() -> Iterator[list[Transport]]:
    """Transports closed after the test."""
    transports: list[Transport] = []
    yield transports
    for transport in transports:
        transport.close()


def round_trip(sender: Transport, receiver: Transport, topic: str) -> list[bytes]:
    """What `receiver` got of one message `sender` published to `topic`."""
    got: list[bytes] = []
    lock = threading.Lock()

    def keep(_: str, payload: bytes) -> None:
        with lock:
            got.append(payload)

    receiver.subscribe(topic, keep)
    sender.publish(topic, b"hello")
    receiver.wait_until(lambda: bool(got), timeout_s=5)
    return got


def test_a_hub_object_is_an_endpoint_and_its_clients_keep_their_wills() -> None:
    # Prepare
    hub = InProcessBroker()
    watcher = connect(hub, "watcher")
    device = connect(hub, "dev-1", Will("pfl/f/device/dev-1/status", b"offline"))
    lost: list[bytes] = []
    watcher.subscribe("pfl/f/device/+/status", lambda _, payload: lost.append(payload))

    # Execute
    device.vanish()
    watcher.wait_until(lambda: bool(lost), timeout_s=1)

    # Assert
    assert isinstance(device, InProcessTransport)
    assert lost == [b"offline"]


def test_an_inproc_url_reaches_the_live_hub_of_that_name() -> None:
    # Prepare
    hub = InProcessBroker(name="factory-test-hub")

    # Execute
    by_url = connect("inproc://factory-test-hub", "by-url")
    by_object = connect(hub, "by-object")

    # Assert: both are clients of the one hub
    assert round_trip(by_url, by_object, "pfl/f/round") == [b"hello"]


def test_a_hub_name_is_taken_while_the_hub_lives_and_free_once_it_is_gone() -> None:
    # Prepare
    hub = InProcessBroker(name="factory-test-once")

    # Execute / Assert
    with pytest.raises(ValueError, match="already exists"):
        InProcessBroker(name="factory-test-once")
    del hub
    gc.collect()
    with pytest.raises(ValueError, match="no in-process hub named 'factory-test-once'"):
        connect("inproc://factory-test-once", "late")
    assert InProcessBroker(name="factory-test-once").name == "factory-test-once"


@pytest.mark.parametrize("name", ["", "a/b", "hub:1", "hub 1"])
def test_a_hub_name_a_url_could_not_say_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="use letters, digits"):
        InProcessBroker(name=name)


def test_an_inproc_url_naming_no_live_hub_lists_the_hubs_there_are() -> None:
    hub = InProcessBroker(name="factory-test-listed")

    with pytest.raises(ValueError, match=r"'nowhere' in this process .*factory-test-listed"):
        connect("inproc://nowhere", "lost")
    assert hub.name == "factory-test-listed"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:1883", "unknown scheme 'http'"),
        ("127.0.0.1:1883", "unknown scheme ''"),
        ("mqtt://", "has no host"),
        ("mqtts://:8883", "has no host"),
        ("mqtt://127.0.0.1:0", "invalid port"),
        ("mqtt://127.0.0.1:70000", "invalid port"),
        ("mqtt://127.0.0.1:1883/pfl", "nothing after the port"),
        ("inproc://", "expected inproc://<hub name>"),
        ("inproc://hub/more", "expected inproc://<hub name>"),
    ],
)
def test_a_bad_url_is_refused_naming_its_scheme_or_host_problem(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as refused:
        connect(url, "nobody")

    assert repr(url) in str(refused.value)


def test_an_mqtt_url_connects_to_that_broker(broker_url: str, opened: list[Transport]) -> None:
    # Prepare
    coordinator = connect(broker_url, "factory-coordinator", clean_start=True)
    opened.append(coordinator)
    device = connect(broker_url, "factory-device", clean_start=True)
    opened.append(device)

    # Execute
    got = round_trip(device, coordinator, "pfl/f/device/factory-device/update")

    # Assert
    assert isinstance(coordinator, MqttTransport)
    assert coordinator.settings == BrokerSettings(url=broker_url)
    assert got == [b"hello"]


def test_broker_settings_carry_what_a_url_cannot_say(
    embedded_broker: Any, opened: list[Transport]
) -> None:
    # Prepare
    settings = BrokerSettings(url=embedded_broker.url, max_payload_bytes=100)

    # Execute
    client = connect(settings, "factory-limited", clean_start=True)
    opened.append(client)

    # Assert: the transport holds the settings' limit, which a bare URL would not have set
    assert client.settings is settings
    with pytest.raises(ProtocolError, match=r"exceeds max_payload_bytes \(100 bytes\)"):
        client.publish("pfl/f/model", bytes(101))


@pytest.mark.mosquitto
def test_mqtts_connects_with_the_ca_of_the_settings_and_not_without(
    mosquitto_tls: tuple[Any, Path], opened: list[Transport]
) -> None:
    # Prepare
    broker, ca_file = mosquitto_tls
    url = broker.url.replace("mqtt://", "mqtts://")

    # Execute
    client = connect(BrokerSettings(url=url, ca_file=str(ca_file)), "factory-tls")
    opened.append(client)

    # Assert
    assert round_trip(client, client, "pfl/f/round") == [b"hello"]
    with pytest.raises(BrokerConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        connect(url, "factory-tls-untrusting")  # a bare URL trusts the system CAs only


@pytest.mark.mosquitto
def test_the_reconnect_hook_runs_once_the_broker_is_back(
    mosquitto: Any, opened: list[Transport]
) -> None:
    # Prepare
    fast = BrokerSettings(url=mosquitto.url, reconnect_min_delay_s=0.2, reconnect_max_delay_s=0.5)
    client = connect(fast, "factory-reconnecting")
    opened.append(client)
    reconnects: list[str] = []
    client.on_reconnect(lambda: reconnects.append("back"))

    # Execute
    mosquitto.restart()
    client.wait_until(lambda: bool(reconnects), timeout_s=10)

    # Assert
    assert reconnects == ["back"]


def test_a_wrapper_hands_the_reconnect_hook_to_the_transport_it_wraps() -> None:
    # Prepare: an in-process transport that records the hook it is given
    class Recording(InProcessTransport):
        hook: object = None

        def on_reconnect(self, hook: Any) -> None:
            self.hook = hook

    inner = Recording(InProcessBroker(), "inner", None)

    def hook() -> None:
        return None

    # Execute
    TransportWrapper(inner).on_reconnect(hook)

    # Assert
    assert inner.hook is hook
