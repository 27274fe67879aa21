"""`pfl-coord provision` output run by a real mosquitto: TLS, passwords and the per-device ACL."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from coordinator.cli.app import app
from coordinator.ops.provision import ProvisionError, provision, verify_password
from device_agent.settings import AgentSettings
from protocols import topics
from protocols.errors import ProtocolError
from protocols.transport.mqtt import BrokerConnectionError, MqttTransport
from protocols.transport.settings import BrokerSettings
from tests.provisioned import ProvisionedBroker, start_provisioned
from tests.wiretap import Inbox

pytestmark = pytest.mark.mosquitto
FLEET = "lab"
QUIET_S = 0.5  # how long a denied message gets to (wrongly) arrive after the marker did


def _start(tmp_path: Path, **options: Any) -> ProvisionedBroker:
    return start_provisioned(tmp_path / "deploy", ["dev-1", "dev-2"], FLEET, **options)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ProvisionedBroker]:
    started = _start(tmp_path)
    yield started
    started.stop()


@pytest.fixture
def connect(broker: ProvisionedBroker) -> Iterator[Callable[..., MqttTransport]]:
    """Connect as the coordinator or a device, with its provisioned password, over TLS."""
    with ExitStack() as opened:  # closes every transport opened, at teardown

        def open_as(user: str, client_id: str | None = None) -> MqttTransport:
            credential = broker.account(user)
            settings = broker.settings(credential.username, credential.password)
            return opened.enter_context(MqttTransport(settings, client_id or f"{user}-test"))

        yield open_as


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
    broker: ProvisionedBroker, connect: Callable[..., MqttTransport]
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
    broker: ProvisionedBroker, connect: Callable[..., MqttTransport]
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
        topics.fleet_status(FLEET),
        topics.fleet_row(FLEET, "dev-1"),  # its own row of the fleet status: the coordinator's
        topics.fleet_row(FLEET, "dev-2"),
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
            f"Denied PUBLISH from dev-1 (d0, q1, r0, m{forbidden.index(topic) + 1}, '{topic}'"
            in log
        )


def test_a_device_does_not_receive_other_devices_messages(
    connect: Callable[..., MqttTransport],
) -> None:
    # mosquitto 2 grants any subscription and filters what it delivers by the ACL
    coordinator, snoop, victim = connect("coordinator"), connect("dev-1"), connect("dev-2")
    snooped, received = Inbox(), Inbox()
    snoop.subscribe(topics.device_subscription(FLEET, "update"), snooped)
    snoop.subscribe(f"pfl/{FLEET}/command/+", snooped)
    snoop.subscribe(f"pfl/{FLEET}/relay/#", snooped)
    snoop.subscribe(topics.run_history(FLEET), snooped)
    coordinator.subscribe(topics.device_subscription(FLEET, "update"), received)
    coordinator.publish(topics.run_history(FLEET), b"every device's results", retain=True)
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
    assert "status: viewer.env; dashboard: dashboard.env;" in " ".join(first.output.split())
    for tool in ("coordinator", "operator", "viewer", "dashboard"):
        assert f"PFL_USERNAME=pfl-{tool}\n" in (tmp_path / "d" / f"{tool}.env").read_text()
        assert credentials[tool]["username"] == f"pfl-{tool}"
    again = runner.invoke(app, arguments)
    assert again.exit_code == 2
    assert "--force" in again.output


def test_no_account_can_take_another_clients_session(
    broker: ProvisionedBroker, connect: Callable[..., MqttTransport]
) -> None:
    # mosquitto alone lets any user connect with any client id and drops the older session;
    # the generated config makes every client id its user name, so the id a client asks for
    # is ignored and an intruder only ever displaces its own account
    coordinator = connect("coordinator", f"pfl-coord-{FLEET}")
    victim = connect("dev-2", "dev-2")
    reconnects: list[str] = []
    coordinator.on_reconnect(lambda: reconnects.append("coordinator"))
    victim.on_reconnect(lambda: reconnects.append("dev-2"))
    updates = Inbox()
    coordinator.subscribe(topics.device_subscription(FLEET, "update"), updates)
    for stolen in (f"pfl-coord-{FLEET}", "pfl-coordinator", "dev-2"):
        connect("dev-1", stolen)
    victim.publish(topics.device(FLEET, "dev-2", "update"), b"still here")
    assert coordinator.wait_until(lambda: len(updates.topics()) == 1, 5)
    time.sleep(QUIET_S)
    assert reconnects == []
    assert coordinator.connected
    assert victim.connected
    log = broker.log.read_text()
    assert "as pfl-coordinator" in log
    assert "as dev-2" in log
    takeovers = [line for line in log.splitlines() if "closing old connection" in line]
    assert takeovers  # the intruder's own connections displace each other, and only those
    assert all("Client dev-1 already connected" in line for line in takeovers), takeovers


def test_the_operator_reads_statuses_and_sends_commands_only(
    broker: ProvisionedBroker, connect: Callable[..., MqttTransport]
) -> None:
    coordinator, device, operator = connect("coordinator"), connect("dev-1"), connect("operator")
    seen, commands = Inbox(), Inbox()
    operator.subscribe(topics.fleet_subtree(FLEET), seen)
    device.subscribe(topics.command(FLEET), commands)
    private = [
        topics.round_announcement(FLEET),
        topics.shared_model(FLEET),
        topics.relay(FLEET, "dev-1"),
    ]
    for topic in private:
        coordinator.publish(topic, b"not for operators")
    device.publish(topics.device(FLEET, "dev-1", "update"), b"a private delta")
    readable = [
        topics.coordinator_status(FLEET),
        topics.fleet_status(FLEET),
        topics.fleet_row(FLEET, "dev-1"),
        topics.run_history(FLEET),  # what the dashboard reads
        topics.device(FLEET, "dev-1", "status"),
        topics.device(FLEET, "dev-1", "export-report"),
    ]
    for topic in readable[:4]:
        coordinator.publish(topic, b"readable")
    for topic in readable[4:]:
        device.publish(topic, b"readable")
    operator.publish(topics.round_announcement(FLEET), b"forged round")
    operator.publish(topics.command(FLEET), b"export")
    assert device.wait_until(lambda: len(commands.topics()) == 1, 5)
    assert operator.wait_until(lambda: len(seen.topics()) >= len(readable), 5)
    time.sleep(QUIET_S)
    assert sorted(set(seen.topics())) == sorted(readable)
    assert "Denied PUBLISH from pfl-operator" in broker.log.read_text()


def test_status_runs_with_the_operator_env_file(broker: ProvisionedBroker) -> None:
    env = dict(
        line.split("=", 1)
        for line in (broker.result.directory / "operator.env").read_text().splitlines()
    )
    assert "PFL_DEVICE_ID" not in env
    assert env["PFL_USERNAME"] == "pfl-operator"
    env["PFL_BROKER"] = f"mqtts://127.0.0.1:{broker.tls_port}"  # provisioned for 127.0.0.1
    result = CliRunner().invoke(app, ["status", "--json", "--listen", "0.3"], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["devices"] == []
    env["PFL_PASSWORD"] = "wrong"
    refused = CliRunner().invoke(app, ["status", "--listen", "0.3"], env=env)
    assert refused.exit_code == 2
    assert "cannot connect" in refused.output


@pytest.mark.parametrize(
    "reserved", ["all", "pfl-coordinator", "pfl-operator", "pfl-viewer", "pfl-coord-x"]
)
def test_reserved_device_ids_are_refused_everywhere(tmp_path: Path, reserved: str) -> None:
    with pytest.raises(ProvisionError, match="reserved"):
        provision(["dev-1", reserved], tmp_path / "deploy")
    assert not (tmp_path / "deploy" / "credentials.json").exists()
    cli = CliRunner().invoke(
        app, ["provision", "--devices", f"ok,{reserved}", "--out", str(tmp_path / "cli")]
    )
    assert cli.exit_code == 2
    assert "reserved" in cli.output
    with pytest.raises(ValidationError, match="reserved"):
        AgentSettings(device_id=reserved, data_shard=0)
    with pytest.raises(ProtocolError, match="reserved"):
        topics.parse_topic(f"pfl/{FLEET}/device/{reserved}/update")
