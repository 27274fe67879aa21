"""The embedded broker admits only its run's accounts, binds client ids to them, applies the ACL."""

from __future__ import annotations

import stat
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.run.embedded import EmbeddedRun, start_embedded
from protocols import topics
from protocols.access import COORDINATOR_USER, OPERATOR_USER
from protocols.transport.broker import EmbeddedBroker
from protocols.transport.mqtt import BrokerConnectionError, MqttTransport
from protocols.transport.run_access import DEVICE_USER, coordinator_client_id
from protocols.transport.settings import BrokerSettings
from tests.conftest import HOST, free_port
from tests.wiretap import Inbox

FLEET = "lab"
QUIET_S = 0.5  # how long a denied message gets to (wrongly) arrive after the marker did
Connect = Callable[..., MqttTransport]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[EmbeddedRun]:
    started = start_embedded(HOST, free_port(), FLEET, tmp_path / "broker")
    yield started
    started.stop()


@pytest.fixture
def connect(run: EmbeddedRun) -> Iterator[Connect]:
    """Connect with `account`'s password (or `password`) and a client id."""
    with ExitStack() as opened:  # closes every transport opened, at teardown

        def open_as(
            account: str | None, client_id: str, password: str | None = None
        ) -> MqttTransport:
            base = BrokerSettings(url=run.broker.url, connect_timeout_s=3, max_takeovers=0)
            settings = base if account is None else run.settings(base, account)
            if password is not None:
                settings = settings.model_copy(update={"password": password})
            return opened.enter_context(MqttTransport(settings, client_id))

        yield open_as


def test_anonymous_unknown_and_wrong_password_clients_are_refused(connect: Connect) -> None:
    attempts = [
        (None, "dev-1", None),  # anonymous
        (DEVICE_USER, "dev-1", "wrong"),
        (COORDINATOR_USER, coordinator_client_id(FLEET), "wrong"),
        (OPERATOR_USER, "pfl-operator-status-1", ""),
    ]
    for account, client_id, password in attempts:
        with pytest.raises(BrokerConnectionError):
            connect(account, client_id, password)
    assert connect(DEVICE_USER, "dev-1").connected


def test_no_client_can_take_the_coordinators_session(connect: Connect, run: EmbeddedRun) -> None:
    # amqtt alone rebinds or deletes the session of a client id before it checks the password,
    # and then drops the connected holder of that id even when the check fails
    coordinator = connect(COORDINATOR_USER, coordinator_client_id(FLEET))
    reconnects: list[str] = []
    coordinator.on_reconnect(lambda: reconnects.append("coordinator"))
    updates = Inbox()
    coordinator.subscribe(topics.device_subscription(FLEET, "update"), updates)
    for account in (DEVICE_USER, OPERATOR_USER, None):
        with pytest.raises(BrokerConnectionError):
            connect(account, coordinator_client_id(FLEET))
    for clean in (True, False):  # raw CONNECTs with no credentials, both session kinds
        raw = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=coordinator_client_id(FLEET),
            protocol=paho.MQTTv311,
            clean_session=clean,
        )
        raw.connect(HOST, run.broker.port)
        raw.loop(1.0)
        raw.loop(0.5)
        assert not raw.is_connected()
        raw.disconnect()
    device = connect(DEVICE_USER, "dev-1")
    device.publish(topics.device(FLEET, "dev-1", "update"), b"still here")
    # Assert: the coordinator never lost its connection, and its subscription still works
    assert coordinator.wait_until(lambda: len(updates.topics()) == 1, 5)
    assert reconnects == []
    assert coordinator.connected


def test_a_device_is_confined_to_its_own_topics(connect: Connect) -> None:
    coordinator = connect(COORDINATOR_USER, coordinator_client_id(FLEET))
    seen = Inbox()
    coordinator.subscribe(topics.fleet_subtree(FLEET), seen)
    intruder = connect(DEVICE_USER, "dev-1")
    forbidden = [
        topics.device(FLEET, "dev-2", "update"),
        topics.round_announcement(FLEET),
        topics.shared_model(FLEET),
        topics.command(FLEET),  # e.g. reset-state to every agent
        topics.command(FLEET, "dev-2"),
        f"{topics.device(FLEET, 'dev-1', 'status')}/junk",  # a new name in its own subtree
    ]
    for topic in forbidden:
        intruder.publish(topic, b"forged", retain=True)
    marker = topics.device(FLEET, "dev-1", "update")
    intruder.publish(marker, b"marker")
    assert coordinator.wait_until(lambda: marker in seen.topics(), 5)
    time.sleep(QUIET_S)
    assert seen.topics() == [marker]
    # it cannot read other devices' updates either: such a subscription is refused
    with pytest.raises(Exception, match="refused the subscription"):
        intruder.subscribe(topics.device_subscription(FLEET, "update"), Inbox())


def test_the_operator_reads_statuses_not_updates(connect: Connect) -> None:
    operator = connect(OPERATOR_USER, "pfl-operator-status-test")
    statuses = Inbox()
    operator.subscribe(topics.device_subscription(FLEET, "status"), statuses)
    with pytest.raises(Exception, match="refused the subscription"):
        operator.subscribe(topics.device_subscription(FLEET, "update"), Inbox())
    device = connect(DEVICE_USER, "dev-1")
    device.publish(topics.device(FLEET, "dev-1", "status"), b"online")
    assert operator.wait_until(lambda: len(statuses.topics()) == 1, 5)


def test_the_env_files_are_private_and_name_this_runs_accounts(run: EmbeddedRun) -> None:
    directory = run.env_files[0].parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in run.env_files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    device_env = dict(
        line.split("=", 1) for line in (directory / "device.env").read_text().splitlines()
    )
    assert device_env["PFL_BROKER"] == run.broker.url
    assert device_env["PFL_USERNAME"] == DEVICE_USER
    assert device_env["PFL_PASSWORD"] == run.access.passwords[DEVICE_USER]
    assert run.access.passwords[COORDINATOR_USER] not in (directory / "operator.env").read_text()


def test_the_embedded_broker_binds_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        EmbeddedBroker("0.0.0.0", free_port(), run_access=None)
