"""Every operator tool at once on the provisioned mosquitto, each with its own account.

The generated config binds client ids to user names, so two tools logging in with one account
would disconnect each other. `serve --dashboard`, `pfl-coord status`, `pfl-coord dashboard` and
`pfl-coord export` run side by side here, as processes with the env files provisioning wrote, and
all of them succeed; the read-only accounts cannot publish commands or models.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.run.simulate import device_name
from protocols import topics
from protocols.transport.mqtt import MqttTransport
from tests.e2e.conftest import CEILING_S, Processes, child_env, sourced, wait_for
from tests.provisioned import ProvisionedBroker, start_provisioned

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(600)]
FLEET = "lab"
DEVICES = 2
ROUNDS = 40
COORD = [sys.executable, "-m", "coordinator.cli.app"]


def snapshot(page: str) -> Any:
    """The dashboard's data, from the URL it printed (token included)."""
    base, _, token = page.partition("?token=")
    request = urllib.request.Request(
        f"{base}api/snapshot", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def tool_env(broker: ProvisionedBroker, name: str) -> dict[str, str]:
    """What `set -a; . <name>.env; set +a` exports, on the TLS listener on loopback."""
    return sourced(broker.result.directory / f"{name}.env")


def test_serve_its_dashboard_status_dashboard_and_export_run_side_by_side(
    tmp_path: Path,
) -> None:
    # Prepare: the provisioned broker, agents and `serve --dashboard`, each from its env file
    devices = [device_name(i) for i in range(DEVICES)]
    broker = start_provisioned(tmp_path / "deploy", devices, FLEET)
    processes = Processes(tmp_path)
    try:
        for index, device_id in enumerate(devices):
            env = sourced(broker.result.directory / "devices" / f"{device_id}.env")
            processes.start(
                device_id,
                [
                    sys.executable, "-m", "device_agent.cli", "start", "--task", "digits",
                    "--data-shard", str(index), "--num-shards", str(DEVICES),
                    "--state-dir", str(tmp_path / "state" / device_id),
                ],
                env,
            )  # fmt: skip
        serve = processes.start(
            "serve",
            [
                *COORD, "serve", "--task", "digits", "--algorithm", "fedavg-ft",
                "--rounds", str(ROUNDS), "--min-devices", str(DEVICES), "--round-timeout", "60",
                "--join-timeout", str(CEILING_S), "--out", str(tmp_path / "run"),
                "--checkpoint-dir", str(tmp_path / "checkpoint"), "--dashboard", "127.0.0.1:0",
            ],
            tool_env(broker, "coordinator"),
        )  # fmt: skip
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, "round 2")
        # Execute: the other three tools while rounds go on
        board = processes.start(
            "dashboard",
            [*COORD, "dashboard", "--listen", "127.0.0.1:0"],
            tool_env(broker, "dashboard"),
        )
        status = subprocess.run(
            [*COORD, "status", "--json", "--listen", "3"],
            env={**child_env(), **tool_env(broker, "viewer")},
            capture_output=True,
            text=True,
            timeout=CEILING_S,
        )
        exported = subprocess.run(
            [*COORD, "export", "--out-dir", str(tmp_path / "exports"), "--json"],
            env={**child_env(), **tool_env(broker, "operator")},
            capture_output=True,
            text=True,
            timeout=CEILING_S,
        )
        found: list[str] = []

        def dashboard_url() -> bool:
            found[:] = re.findall(r"dashboard on (\S+)", processes.log("dashboard"))
            return bool(found)

        wait_for(dashboard_url, "the dashboard's URL")
        served: list[Any] = []

        def dashboard_sees_rounds() -> bool:
            served.append(snapshot(found[0]))
            return bool(served[-1]["rounds"])

        wait_for(dashboard_sees_rounds, "rounds on the dashboard")
        assert board.poll() is None, processes.log("dashboard")
        serve.wait(timeout=CEILING_S * 2)
    finally:
        processes.stop_all()
        broker.stop()
    # Assert: every tool did its job, and the broker never dropped anyone for a newcomer
    assert serve.returncode == 0, processes.log("serve")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == ROUNDS
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["coordinator"]["state"] in {"running", "waiting"}
    assert exported.returncode == 0, exported.stdout + exported.stderr
    result = json.loads(exported.stdout)
    assert result["ok"] is True, result
    assert sorted(row["device"] for row in result["devices"]) == devices
    log = broker.log.read_text()
    assert "already connected" not in log
    for user in ("pfl-coordinator", "pfl-viewer", "pfl-dashboard", "pfl-operator"):
        assert re.search(rf"New client connected from \S+ as {user}\b", log), user


def test_viewer_accounts_cannot_publish_commands_or_models(tmp_path: Path) -> None:
    # Prepare
    broker = start_provisioned(tmp_path / "deploy", [device_name(0)], FLEET)
    coordinator = broker.result.coordinator
    device = broker.result.devices[device_name(0)]
    received: list[str] = []
    try:
        with (
            MqttTransport(
                broker.settings(device.username, device.password), device.username
            ) as agent,
            MqttTransport(
                broker.settings(coordinator.username, coordinator.password), "pfl-coord-lab"
            ) as coord,
        ):
            for pattern in (topics.command(FLEET), topics.command(FLEET, device.username)):
                agent.subscribe(pattern, lambda topic, _: received.append(topic))
            coord.subscribe(topics.fleet_subtree(FLEET), lambda topic, _: received.append(topic))
            # Execute: each read-only account tries to command the fleet and replace the model
            for viewer in (broker.result.viewer, broker.result.dashboard):
                settings = broker.settings(viewer.username, viewer.password)
                with MqttTransport(settings, viewer.username) as tool:
                    for topic in (
                        topics.command(FLEET),
                        topics.command(FLEET, device.username),
                        topics.shared_model(FLEET),
                        topics.round_announcement(FLEET),
                    ):
                        tool.publish(topic, b"forged")
            # a message from an allowed account after them: once it arrives, theirs would have
            coord.publish(topics.command(FLEET), b"real")
            wait_for(lambda: received.count(topics.command(FLEET)) == 2, "the real command")
    finally:
        broker.stop()
    # Assert: nothing forged arrived; the broker says it denied each attempt
    assert received.count(topics.command(FLEET)) == 2, received  # the real one, at both clients
    assert topics.command(FLEET, device.username) not in received
    assert topics.shared_model(FLEET) not in received
    log = broker.log.read_text()
    for user in ("pfl-viewer", "pfl-dashboard"):
        denied = re.findall(rf"Denied PUBLISH from {user}\b", log)
        assert len(denied) == 4, (user, denied)
