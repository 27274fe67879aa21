"""`serve --dashboard` on the provisioned mosquitto keeps the coordinator's one MQTT session.

The broker binds client ids to user names, so any second client logging in with the coordinator's
account takes its session over. The dashboard inside `serve` is fed by the engine itself: with the
page polled throughout a run of many short rounds, the coordinator connects once and the run ends.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import ServeSettings
from coordinator.run.simulate import device_name
from tests.e2e.conftest import Processes
from tests.provisioned import start_provisioned

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(240)]
FLEET = "lab"
DEVICES = 2
ROUNDS = 12


def dashboard_get(url: str, path: str) -> Any:
    """GET `path` of the dashboard printed as `url` (with its token, when it has one)."""
    base, _, token = url.partition("?token=")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{base}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def test_serve_with_its_dashboard_polled_keeps_one_mqtt_session(tmp_path: Path) -> None:
    # Prepare: the provisioned broker (client id = user name) and two agents with their accounts
    broker = start_provisioned(tmp_path / "deploy", [device_name(i) for i in range(DEVICES)], FLEET)
    processes = Processes(tmp_path)
    url, ca_file = broker.url, str(broker.result.files["ca.crt"])
    lines: list[str] = []
    outcome: list[ServeResult | BaseException] = []
    polls: list[dict[str, Any]] = []
    settings = ServeSettings.load(
        None,
        task="digits",
        algorithm="fedavg",
        **broker.coordinator_options(),
        fleet=FLEET,
        rounds=ROUNDS,
        min_devices=DEVICES,
        round_timeout=30.0,
        join_timeout=90.0,
        out=tmp_path / "run",
        checkpoint_dir=tmp_path / "checkpoint",
        dashboard="127.0.0.1:0",
    )

    def serve() -> None:
        try:
            outcome.append(run_serve(settings, notify=lines.append))
        except BaseException as error:
            outcome.append(error)

    try:
        for index in range(DEVICES):
            account = broker.account(device_name(index))
            processes.agent(
                url,
                index,
                shards=DEVICES,
                extra=(
                    "--fleet", FLEET,
                    "--username", account.username,
                    "--password", account.password,
                    "--ca-file", ca_file,
                ),
            )  # fmt: skip
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        # Execute: poll the page's data all through the run
        page = ""
        while thread.is_alive():
            found = [re.search(r"dashboard on (\S+)", line) for line in lines]
            page = page or next((m.group(1) for m in found if m), "")
            try:
                if page:
                    polls.append(dashboard_get(page, "api/snapshot"))
            except OSError:  # the dashboard closes as the run ends, and only then
                thread.join(30.0)
                assert outcome, "the dashboard stopped answering during the run"
            time.sleep(0.1)
        thread.join()
    finally:
        processes.stop_all()
        broker.stop()
    # Assert: every round ran, the page followed them, and the broker saw one coordinator login
    (result,) = outcome
    assert isinstance(result, ServeResult), result
    assert [r.round_id for r in result.records] == list(range(1, ROUNDS + 1))
    assert len(polls) > ROUNDS
    assert max(len(p["rounds"]) for p in polls) >= ROUNDS - 1
    log = broker.log.read_text()
    assert "already connected" not in log
    coordinator = broker.account("coordinator").username
    logins = re.findall(rf"New client connected from \S+ as {coordinator}\b", log)
    assert len(logins) == 2, logins  # MQTT 3.1.1: one to drop an old session, one to stay
