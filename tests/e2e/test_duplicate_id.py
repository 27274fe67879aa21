"""Two agent processes started with one device id: one says why and exits, the coordinator tells."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import coordinator.run.serve as serve_module
from coordinator.ops.status import collect_fleet_view
from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings
from protocols.errors import RoundError
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto, free_port, wait_for_port
from tests.e2e.conftest import (
    CEILING_S,
    Processes,
    account_flags,
    serve_settings,
    wait_for,
)

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]
CAUSE = "probably runs with the same id"


class _SeenEnoughError(Exception):
    """Ends a serve run's wait from its notices once the test has seen what it checks."""


def _two_agents_with_one_id(processes: Processes, url: str, account: tuple[str, ...] = ()) -> None:
    # two boards, one copied command line: the same --device-id
    processes.fleet(url, 2, extra=("--device-id", "dev-1", *account))


def test_on_mosquitto_one_agent_gives_up_and_serve_names_the_flapping_id(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_module, "WAIT_PROGRESS_S", 1.0)
    lines: list[str] = []
    # its join timeout (the test's ceiling) is never reached: the wait ends once all was seen
    settings = serve_settings(
        mosquitto.url, tmp_path, task="digits", algorithm="fedavg", rounds=1, min_devices=2
    )
    _two_agents_with_one_id(processes, mosquitto.url)

    def notify(line: str) -> None:  # ends the wait once everything to check has happened
        lines.append(line)
        progress = [line for line in lines if line.startswith("waiting for 2 device(s)")]
        gave_up = [p for p in processes.running.values() if p.poll() not in (None, 0)]
        if len(progress) >= 8 and gave_up and "rejoining every few seconds" in progress[-1]:
            raise _SeenEnoughError

    # Execute: the coordinator waits for two devices that cannot both be there (the join
    # timeout is the test's ceiling: an agent start-up and a give-up can be slow)
    with pytest.raises(_SeenEnoughError):
        run_serve(settings, notify=notify)
    # Assert: it said who was there and which id keeps rejoining, at a steady pace
    progress = [line for line in lines if line.startswith("waiting for 2 device(s)")]
    assert any("rejoining every few seconds" in line and "dev-1" in line for line in progress)
    assert "s until the join timeout" in progress[-1]
    # one agent gave up with the cause, in one error line, and a non-zero exit
    exits = {name: process.poll() for name, process in processes.running.items()}
    gave_up = [name for name, code in exits.items() if code not in (None, 0)]
    assert len(gave_up) == 1, exits
    assert exits[gave_up[0]] == 2
    assert CAUSE in processes.log(gave_up[0]).replace("\n", " ")
    (survivor,) = set(exits) - set(gave_up)
    assert exits[survivor] is None  # still running, and it keeps the id
    view = collect_fleet_view(BrokerSettings(url=mosquitto.url), "default", listen_s=1.0)
    assert view.fleet is not None
    assert [(d.device_id, d.flapping) for d in view.fleet.devices] == [("dev-1", True)]


def test_on_the_embedded_broker_serve_names_the_id_two_agents_share(
    processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # amqtt hands the session over once and keeps the older connection open, so neither agent
    # is knocked off again; the coordinator still sees a second instance of one id join
    monkeypatch.setattr(serve_module, "WAIT_PROGRESS_S", 1.0)
    port = free_port()
    lines: list[str] = []
    settings = ServeSettings.load(
        None,
        task="digits",
        algorithm="fedavg",
        port=port,
        rounds=1,
        min_devices=2,
        join_timeout=CEILING_S,  # never reached: the wait ends once the flapping id is named
        out=tmp_path / "run",
        checkpoint_dir=tmp_path / "checkpoint",
    )
    result: list[BaseException] = []

    def notify(line: str) -> None:
        lines.append(line)
        if "rejoining every few seconds" in line and "dev-1" in line:
            raise _SeenEnoughError

    def serve() -> None:
        try:
            run_serve(settings, notify=notify)
        except (RoundError, _SeenEnoughError) as error:
            result.append(error)

    thread = threading.Thread(target=serve)
    thread.start()
    assert wait_for_port(port, timeout_s=CEILING_S)
    account = account_flags(tmp_path / "run" / "broker" / "device.env")
    _two_agents_with_one_id(processes, f"mqtt://127.0.0.1:{port}", account)
    thread.join(CEILING_S * 2)
    assert result, lines
    assert isinstance(result[0], _SeenEnoughError), result[0]
    (named,) = [line for line in lines if "rejoining every few seconds" in line]
    assert "waiting for 2 device(s): 1 online (dev-1)" in named  # one id, two agents


def test_a_lone_agent_reconnecting_after_a_broker_restart_keeps_going(
    mosquitto: Mosquitto, processes: Processes
) -> None:
    processes.agent(mosquitto.url, 0, shards=1)
    broker = BrokerSettings(url=mosquitto.url)
    wait_for(  # connected first: an unreachable broker at start is fatal
        lambda: "dev-0000" in collect_fleet_view(broker, "default", listen_s=0.5).devices,
        "the agent's first connection",
    )

    def connections() -> int:
        return mosquitto.log_text().count(" as dev-0000 ")

    for _ in range(4):  # short-lived connections, but no other client with its id
        before = connections()
        mosquitto.restart(down_s=0.3)
        wait_for(lambda: connections() > before, "the agent's reconnection")  # noqa: B023
    ((name, process),) = processes.running.items()
    assert process.poll() is None, processes.log(name)
    assert "same id" not in processes.log(name)
