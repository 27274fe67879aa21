"""Garbage sent to an agent costs one log line per interval, no tracebacks, and nothing else."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from device_agent.runner import build_agent
from device_agent.settings import AgentSettings
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import Command
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto

FRAMES = 40


def test_bad_frames_log_one_line_and_the_agent_keeps_answering(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a real agent on mosquitto, and a client that can write the fleet's topics
    settings = AgentSettings(
        broker=mosquitto.url, device_id="dev-1", data_shard=0, num_shards=2, state_dir=tmp_path
    )
    agent = build_agent(settings)
    agent.start()
    agent.downloads.fetch("model")  # as while it waits for a model: it reads the model topic too
    sender = MqttTransport(BrokerSettings(url=mosquitto.url), "garbage")
    hellos: list[bytes] = []
    sender.subscribe(topics.device("default", "dev-1", "hello"), lambda _t, p: hellos.append(p))
    caplog.set_level(logging.WARNING)
    try:
        # Execute: garbage on every topic the agent reads, then a valid command
        for index in range(FRAMES):
            for topic in (
                topics.round_announcement("default"),
                topics.shared_model("default"),
                topics.command("default", "dev-1"),
            ):
                sender.publish(topic, b"PFL\x01 not a frame %d" % index)
        sender.publish(topics.command("default", "dev-1"), encode_frame(Command(action="hello")))
        # Assert: the agent is still answering, with a bounded, traceback-free log
        assert sender.wait_until(lambda: len(hellos) >= 1, 10.0)
    finally:
        sender.close()
        agent.stop()
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert 1 <= len(dropped) <= 2, [r.getMessage() for r in dropped]
    assert all(r.exc_info is None for r in caplog.records)
    assert all("\n" not in r.getMessage() for r in caplog.records)
    assert isinstance(agent.transport, MqttTransport)
    assert agent.transport.offences.counts() == {"": 3 * FRAMES}
