"""`pfl-coord provision` output run by a real mosquitto: TLS, passwords and the per-device ACL."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.provision import ProvisionResult, provision, verify_password
from protocols import topics
from protocols.transport.mqtt import BrokerConnectionError, MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import free_port, mosquitto_binary, wait_for_port

pytestmark = pytest.mark.mosquitto
FLEET = "lab"
QUIET_S = 0.5  # how long a denied message gets to (wrongly) arrive after the marker did


class Inbox:
    """(topic, payload) pairs from a transport's dispatch thread."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self.messages.append((topic, payload))

    def topics(self) -> list[str]:
        with self._lock:
            return [topic for topic, _ in self.messages]


class ProvisionedBroker:
    """mosquitto started from the generated mosquitto.conf, on free loopback ports."""

    def __init__(self, result: ProvisionResult, tls_port: int, plain_port: int) -> None:
        self.result = result
        self.tls_port = tls_port
        self.plain_port = plain_port
        self.log = result.directory / "mosquitto.log"
        config = result.files["mosquitto.conf"].read_text()
        # As root, mosquitto would drop to its own user, who cannot read pytest's 0700 tmp dirs.
        config += "user root\n" if os.geteuid() == 0 else ""
        config += "persistence false\nlog_dest stderr\nlog_type all\n"
        self.config = result.directory / "mosquitto-test.conf"
        self.config.write_text(config)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [mosquitto_binary(), "-c", str(self.config)], stdout=subprocess.DEVNULL, stderr=log
            )
        if not (wait_for_port(tls_port) and wait_for_port(plain_port)):
            self.stop()
            pytest.fail(f"provisioned mosquitto did not start; its log:\n{self.log.read_text()}")

    def settings(self, username: str | None, password: str | None, **extra: Any) -> BrokerSettings:
        """Settings for the TLS listener with the generated CA."""
        return BrokerSettings(
            url=f"mqtts://127.0.0.1:{self.tls_port}",
            ca_file=str(self.result.files["ca.crt"]),
            username=username,
            password=password,
            connect_timeout_s=5,
            **extra,
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def _start(tmp_path: Path, **options: Any) -> ProvisionedBroker:
    tls_port, plain_port = free_port(), free_port()
    result = provision(
        ["dev-1", "dev-2"],
        tmp_path / "deploy",
        fleet=FLEET,
        host="127.0.0.1",
        tls_port=tls_port,
        plain_port=plain_port,
        **options,
    )
    return ProvisionedBroker(result, tls_port, plain_port)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ProvisionedBroker]:
    started = _start(tmp_path)
    yield started
    started.stop()


@pytest.fixture
def connect(broker: ProvisionedBroker) -> Iterator[Callable[[str], MqttTransport]]:
    """Connect as the coordinator or a device, with its provisioned password, over TLS."""
    opened: list[MqttTransport] = []

    def open_as(user: str) -> MqttTransport:
        result = broker.result
        credential = result.coordinator if user == "coordinator" else result.devices[user]
        transport = MqttTransport(
            broker.settings(credential.username, credential.password), f"{user}-test"
        )
        opened.append(transport)
        return transport

    yield open_as
    for transport in opened:
        transport.close()


def test_provision_writes_a_consistent_deployment(broker: ProvisionedBroker) -> None:
    result = broker.result
    credentials = json.loads(result.files["credentials.json"].read_text())
    assert set(credentials["devices"]) == {"dev-1", "dev-2"}
    assert credentials["devices"]["dev-1"]["password"] == result.devices["dev-1"].password
    passwords = dict(
        line.split(":", 1) for line in result.files["passwords"].read_text().splitlines()
    )
    assert verify_password(result.devices["dev-2"].password, passwords["dev-2"])
    assert not verify_password("wrong", passwords["dev-2"])
    for secret in ("passwords", "credentials.json", "ca.key", "dev-1.key"):
        assert result.files[secret].stat().st_mode & 0o077 == 0, secret
    env = (result.directory / "devices" / "dev-1.env").read_text()
    assert f"PFL_PASSWORD={result.devices['dev-1'].password}\n" in env
    assert f"PFL_BROKER=mqtts://127.0.0.1:{broker.tls_port}\n" in env


def test_a_device_publishes_its_update_and_reads_the_round(
    broker: ProvisionedBroker, connect: Callable[[str], MqttTransport]
) -> None:
    coordinator, device = connect("coordinator"), connect("dev-1")
    updates, rounds = Inbox(), Inbox()
    coordinator.subscribe(topics.device_subscription(FLEET, "update"), updates)
    device.subscribe(topics.round_announcement(FLEET), rounds)
    coordinator.publish(topics.round_announcement(FLEET), b"round 1", retain=True)
    device.publish(topics.device(FLEET, "dev-1", "update"), b"delta")
    assert coordinator.wait_until(lambda: len(updates.topics()) == 1, 5)
    assert device.wait_until(lambda: len(rounds.topics()) == 1, 5)
    assert updates.messages == [(topics.device(FLEET, "dev-1", "update"), b"delta")]
    assert rounds.messages == [(topics.round_announcement(FLEET), b"round 1")]


def test_a_device_cannot_publish_outside_its_subtree(
    broker: ProvisionedBroker, connect: Callable[[str], MqttTransport]
) -> None:
    coordinator, intruder = connect("coordinator"), connect("dev-1")
    seen = Inbox()
    coordinator.subscribe(topics.fleet_subtree(FLEET), seen)
    forbidden = [
        topics.device(FLEET, "dev-2", "update"),
        topics.device(FLEET, "dev-2", "status"),
        topics.round_announcement(FLEET),
        topics.shared_model(FLEET),
        topics.chunk_topic(topics.shared_model(FLEET), 0),
        topics.coordinator_status(FLEET),
        topics.command(FLEET),
        topics.command(FLEET, "dev-2"),
        "pfl/other-fleet/device/dev-1/update",
    ]
    for topic in forbidden:
        intruder.publish(topic, b"forged")
    marker = topics.device(FLEET, "dev-1", "update")
    intruder.publish(marker, b"marker")  # allowed, and sent after every forged message
    assert coordinator.wait_until(lambda: marker in seen.topics(), 5)
    time.sleep(QUIET_S)
    assert seen.topics() == [marker]
    log = broker.log.read_text()
    for topic in forbidden:
        assert (
            f"Denied PUBLISH from dev-1-test (d0, q1, r0, m{forbidden.index(topic) + 1}, '{topic}'"
            in log
        )


def test_a_device_does_not_receive_other_devices_messages(
    connect: Callable[[str], MqttTransport],
) -> None:
    # mosquitto 2 grants any subscription and filters what it delivers by the ACL
    coordinator, snoop, victim = connect("coordinator"), connect("dev-1"), connect("dev-2")
    snooped, received = Inbox(), Inbox()
    snoop.subscribe(topics.device_subscription(FLEET, "update"), snooped)
    snoop.subscribe(f"pfl/{FLEET}/command/+", snooped)
    snoop.subscribe(f"pfl/{FLEET}/relay/#", snooped)
    coordinator.subscribe(topics.device_subscription(FLEET, "update"), received)
    victim.publish(topics.device(FLEET, "dev-2", "update"), b"private delta")
    coordinator.publish(topics.command(FLEET, "dev-2"), b"for dev-2 only")
    coordinator.publish(topics.relay(FLEET, "dev-2"), b"models relayed to dev-2")
    coordinator.publish(topics.chunk_topic(topics.relay(FLEET, "dev-2"), 0), b"a chunk of them")
    coordinator.publish(topics.command(FLEET, "dev-1"), b"for dev-1")
    coordinator.publish(topics.relay(FLEET, "dev-1"), b"models relayed to dev-1")
    assert snoop.wait_until(lambda: len(snooped.topics()) == 2, 5)
    assert coordinator.wait_until(lambda: len(received.topics()) == 1, 5)
    time.sleep(QUIET_S)
    assert snooped.messages == [
        (topics.command(FLEET, "dev-1"), b"for dev-1"),
        (topics.relay(FLEET, "dev-1"), b"models relayed to dev-1"),
    ]


def test_connections_without_the_right_password_are_refused(broker: ProvisionedBroker) -> None:
    attempts = {
        "anonymous": (None, None),
        "wrong password": ("dev-1", "not-the-password"),
        "another device's password": ("dev-1", broker.result.devices["dev-2"].password),
        "unknown user": ("dev-9", broker.result.devices["dev-1"].password),
    }
    for label, (username, password) in attempts.items():
        with pytest.raises(BrokerConnectionError, match="cannot connect"):
            MqttTransport(broker.settings(username, password), f"probe-{label.replace(' ', '-')}")
    plain = BrokerSettings(url=f"mqtt://127.0.0.1:{broker.plain_port}", connect_timeout_s=5)
    with pytest.raises(BrokerConnectionError, match="cannot connect"):
        MqttTransport(plain, "probe-plain-anonymous")


def test_the_broker_accepts_hashes_made_in_python(tmp_path: Path) -> None:
    started = _start(tmp_path, use_mosquitto_passwd=False)
    try:
        credential = started.result.devices["dev-2"]
        assert "$7$101$" in started.result.files["passwords"].read_text()
        MqttTransport(started.settings(credential.username, credential.password), "py").close()
        with pytest.raises(BrokerConnectionError):
            MqttTransport(started.settings(credential.username, "wrong"), "py-wrong")
    finally:
        started.stop()


def test_the_cli_provisions_and_refuses_to_overwrite(tmp_path: Path) -> None:
    runner = CliRunner()
    arguments = ["provision", "--devices", "a-1,a-2", "--out", str(tmp_path / "d"), "--fleet", "f"]
    first = runner.invoke(app, [*arguments, "--host", "broker.lan"])
    assert first.exit_code == 0, first.output
    credentials = json.loads((tmp_path / "d" / "credentials.json").read_text())
    assert credentials["broker_url"] == "mqtts://broker.lan:8883"
    assert "a-2" in (tmp_path / "d" / "acl").read_text()
    again = runner.invoke(app, arguments)
    assert again.exit_code == 2
    assert "--force" in again.output
