"""A device flooding the coordinator with never-completing chunks does not shut others out."""

from __future__ import annotations

import os
import time

from protocols.transport import chunking
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto

FLOOD = 5000


def test_honest_messages_get_through_a_chunk_flood_on_mosquitto(mosquitto: Mosquitto) -> None:
    coordinator = MqttTransport(BrokerSettings(url=mosquitto.url), "flood-coordinator")
    evil = MqttTransport(BrokerSettings(url=mosquitto.url), "evil")
    honest = MqttTransport(BrokerSettings(url=mosquitto.url), "honest")
    received: list[str] = []
    try:
        coordinator.subscribe("pfl/f/device/+/update", lambda topic, _: received.append(topic))
        coordinator.subscribe("pfl/f/device/+/hello", lambda topic, _: received.append(topic))
        first_chunks = [chunking.split(os.urandom(300), 200)[0] for _ in range(FLOOD)]
        for index, chunk in enumerate(first_chunks):
            evil.publish("pfl/f/device/evil/update/chunk/0", chunk)
            if index == FLOOD // 2:
                honest.publish("pfl/f/device/honest/hello", b"hello")
        assert coordinator.wait_until(lambda: "pfl/f/device/honest/hello" in received, 20.0)
        seen = [-1]

        def settled() -> bool:  # the broker may shed part of the flood; what arrives is counted
            count = coordinator.offences.counts().get("evil", 0)
            done, seen[0] = count == seen[0], count
            time.sleep(0.5)
            return done and count > 0

        assert coordinator.wait_until(settled, 30.0)
        counts = coordinator.offences.counts()
        assert set(counts) == {"evil"}, counts  # the honest device lost nothing
    finally:
        for transport in (evil, honest, coordinator):
            transport.close()
