"""The provisioned mosquitto bounds what one device can store on it: retained topics and sizes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.ops.broker_config import BrokerLimits
from protocols import access, topics
from tests.provisioned import ProvisionedBroker, start_provisioned

pytestmark = pytest.mark.mosquitto
FLEET = "lab"
FLOOD = 300  # new topic names the device tries to leave a retained message on


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ProvisionedBroker]:
    started = start_provisioned(tmp_path / "deploy", ["dev-1", "dev-2"], FLEET)
    yield started
    started.stop()


class Client:
    """A raw paho client over the provisioned TLS listener: exact topics, retain flags, sizes."""

    def __init__(self, broker: ProvisionedBroker, user: str) -> None:
        credential = broker.account(user)
        self.retained: dict[str, bytes] = {}
        self.disconnected = threading.Event()
        self._lock = threading.Lock()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=credential.username, protocol=paho.MQTTv311
        )
        self.client.username_pw_set(credential.username, credential.password)
        self.client.tls_set(ca_certs=str(broker.result.files["ca.crt"]))
        self.client.on_message = self._on_message
        self.client.on_disconnect = lambda *_: self.disconnected.set()
        self.client.reconnect_delay_set(60, 60)  # a dropped client stays dropped in the test
        self.client.connect("127.0.0.1", broker.tls_port)
        self.client.loop_start()

    def _on_message(self, _client: object, _data: object, message: paho.MQTTMessage) -> None:
        if message.retain:
            with self._lock:
                self.retained[message.topic] = bytes(message.payload)

    def publish_all(self, messages: list[tuple[str, bytes]]) -> None:
        """Publish each retained at QoS 1 and wait for the broker's acknowledgements."""
        for topic, payload in messages:
            info = self.client.publish(topic, payload, qos=1, retain=True)
            info.wait_for_publish(10)

    def retained_under(self, pattern: str, settle_s: float = 1.0) -> dict[str, bytes]:
        """Every retained message the broker holds under `pattern` (a fresh subscription)."""
        self.client.subscribe(pattern, qos=1)
        time.sleep(settle_s)  # retained messages arrive right after the SUBACK; nothing else does
        with self._lock:
            return dict(self.retained)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_device_cannot_leave_retained_messages_on_topics_of_its_choosing(
    broker: ProvisionedBroker,
) -> None:
    # Prepare: the device's allowed status, then a flood of new names under its own subtree
    device = Client(broker, "dev-1")
    status = topics.device(FLEET, "dev-1", "status")
    update = topics.device(FLEET, "dev-1", "update")
    max_chunks = BrokerLimits().max_chunks
    flood = [
        (f"{topics.device_subtree(FLEET, 'dev-1')[:-1]}junk/{i}", b"x" * 1000) for i in range(FLOOD)
    ]
    flood += [(topics.chunk_topic(update, max_chunks + i), b"x" * 1000) for i in range(FLOOD)]
    flood += [(f"{status}/{i}", b"x" * 1000) for i in range(FLOOD)]
    # Execute
    device.publish_all([(status, b"online"), *flood, (topics.chunk_topic(update, 0), b"c0")])
    coordinator = Client(broker, "coordinator")
    stored = coordinator.retained_under(topics.fleet_subtree(FLEET))
    device.close()
    coordinator.close()
    # Assert: only the two names the ACL lets the device write kept a retained message
    assert stored == {status: b"online", topics.chunk_topic(update, 0): b"c0"}
    assert "Denied PUBLISH from dev-1" in broker.log.read_text()


def test_a_message_over_one_chunk_disconnects_its_sender_and_is_not_stored(
    broker: ProvisionedBroker,
) -> None:
    # Prepare
    device = Client(broker, "dev-1")
    status = topics.device(FLEET, "dev-1", "status")
    device.publish_all([(status, b"online")])
    huge = b"x" * (BrokerLimits().max_packet_bytes + 1)
    # Execute
    device.client.publish(status, huge, qos=1, retain=True)
    dropped = device.disconnected.wait(10)
    coordinator = Client(broker, "coordinator")
    stored = coordinator.retained_under(topics.fleet_subtree(FLEET))
    device.close()
    coordinator.close()
    # Assert
    assert dropped
    assert stored == {status: b"online"}


def test_the_generated_config_bounds_packets_queues_and_in_flight_messages(
    broker: ProvisionedBroker,
) -> None:
    config = broker.result.files["mosquitto.conf"].read_text().splitlines()
    limits = BrokerLimits()
    assert f"max_packet_size {limits.max_packet_bytes}" in config
    assert f"max_queued_bytes {limits.max_queued_bytes}" in config
    assert any(line.startswith("max_queued_messages ") for line in config)
    assert any(line.startswith("max_inflight_messages ") for line in config)
    # what one device can write is a finite list of names, so its retained data is bounded
    grants = access.device_grants(FLEET, "dev-1", limits.max_chunks)
    writable = [grant.pattern for grant in grants if "write" in grant.access]
    assert not any("+" in pattern or "#" in pattern for pattern in writable)
    assert len(writable) == len(topics.DEVICE_TOPIC_KINDS) + 2 * limits.max_chunks
    assert limits.retained_bound_bytes(FLEET, "dev-1") == len(writable) * limits.max_packet_bytes
