"""What crosses a site's bridge, and who may write partial aggregates, on provisioned brokers."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from coordinator.ops.provision import Credential, ProvisionResult, provision
from coordinator.ops.site_brokers import Site
from coordinator.tier import wire
from protocols import topics
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.conftest import free_port, mosquitto_binary, wait_for_port
from tests.wiretap import Inbox

pytestmark = pytest.mark.mosquitto
FLEET = "f"
QUIET_S = 0.5  # how long a denied message gets to (wrongly) arrive after the marker did
CEILING_S = 60.0


class _Deployment:
    """A core broker with a site on it ("here") and a bridged site ("a"), from provision."""

    def __init__(self, out: Path, opened: ExitStack) -> None:
        self.core, self.site = free_port(), free_port()
        self.result: ProvisionResult = provision(
            [],
            out,
            fleet=FLEET,
            host="127.0.0.1",
            tls_port=self.core,
            sites=[Site("a", ("dev-a",), self.site), Site("here", ("dev-h",))],
        )
        self.opened = opened
        self.processes = [
            self._start(self.result.files["mosquitto.conf"], self.core),
            self._start(self.result.sites["a"].files["mosquitto.conf"], self.site),
        ]
        self.core_log = out / f"mosquitto-{self.core}.log"

    def _start(self, config: Path, port: int) -> subprocess.Popen[bytes]:
        text = config.read_text() + ("user root\n" if os.geteuid() == 0 else "")
        test_config = config.with_name(f"mosquitto-test-{port}.conf")
        test_config.write_text(text + "persistence false\nlog_dest stderr\nlog_type all\n")
        with (self.result.directory / f"mosquitto-{port}.log").open("ab") as log:
            process = subprocess.Popen(
                [mosquitto_binary(), "-c", str(test_config)], stdout=subprocess.DEVNULL, stderr=log
            )
        assert wait_for_port(port), f"mosquitto on {port} did not start"
        return process

    def connect(self, port: int, credential: Credential) -> MqttTransport:
        settings = BrokerSettings(
            url=f"mqtts://127.0.0.1:{port}",
            ca_file=str(self.result.files["ca.crt"]),
            username=credential.username,
            password=credential.password,
            connect_timeout_s=5,
        )
        return self.opened.enter_context(MqttTransport(settings, credential.username))

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            process.wait(timeout=10)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[_Deployment]:
    with ExitStack() as opened:
        started = _Deployment(tmp_path / "deploy", opened)
        yield started
        opened.close()
        started.stop()


def _bridged(deployment: _Deployment) -> None:
    deadline = time.monotonic() + CEILING_S
    while " as pfl-bridge-a " not in deployment.core_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the site's bridge did not reach the core"
        time.sleep(0.1)


def test_only_the_sites_own_partials_cross_its_bridge_and_updates_stay(
    deployment: _Deployment,
) -> None:
    # Prepare
    _bridged(deployment)
    result = deployment.result
    coordinator = deployment.connect(deployment.core, result.coordinator)
    seen = Inbox()
    coordinator.subscribe(topics.fleet_subtree(FLEET), seen)
    aggregator = deployment.connect(deployment.site, result.sites["a"].aggregator)
    device = deployment.connect(deployment.site, result.devices["dev-a"])
    # Execute: forged partials, and an update that stays at the site
    aggregator.publish(wire.partial_topic(FLEET, "here"), b"forged")  # another site's name
    device.publish(wire.partial_topic(FLEET, "a"), b"forged")  # a device is no aggregator
    device.publish(topics.device(FLEET, "dev-a", "update"), b"update")  # allowed at the site
    marker = wire.partial_topic(FLEET, "a")
    aggregator.publish(marker, b"marker")
    # Assert
    assert coordinator.wait_until(lambda: marker in seen.topics(), CEILING_S)
    time.sleep(QUIET_S)
    assert seen.topics() == [marker]
    assert seen.payloads() == [b"marker"]


def test_a_site_on_the_core_has_its_aggregator_read_updates_there(
    deployment: _Deployment,
) -> None:
    # Prepare
    result = deployment.result
    coordinator = deployment.connect(deployment.core, result.coordinator)
    partials = Inbox()
    coordinator.subscribe(wire.partial_subscription(FLEET), partials)
    aggregator = deployment.connect(deployment.core, result.sites["here"].aggregator)
    updates = Inbox()
    aggregator.subscribe(topics.device_subscription(FLEET, "update"), updates)
    device = deployment.connect(deployment.core, result.devices["dev-h"])
    # Execute
    device.publish(topics.device(FLEET, "dev-h", "update"), b"update")
    aggregator.publish(wire.partial_topic(FLEET, "a"), b"forged")  # the bridged site's name
    aggregator.publish(wire.partial_topic(FLEET, "here"), b"marker")
    # Assert
    assert aggregator.wait_until(updates.has(1), CEILING_S)
    assert coordinator.wait_until(partials.has(1), CEILING_S)
    time.sleep(QUIET_S)
    assert updates.payloads() == [b"update"]
    assert partials.payloads() == [b"marker"]
