"""A stall you can see: serve over mosquitto with agent processes, one of them killed mid-run.

The coordinator's retained status goes from running to waiting, naming the killed device and
the deadline (in the round, while the broker still counts it connected, or between rounds, once
its last-will arrived), then on to finished once the device is back; the in-process dashboard
shows the waiting state in a headless Chromium and stays up after the run until serve's caller
lets go.
"""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine.rounds import RoundRecord
from coordinator.ops.status import FleetView, watch_fleet
from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import ServeSettings
from protocols.messages import CoordinatorStatus
from protocols.transport.settings import BrokerSettings
from tests.conftest import Mosquitto
from tests.e2e.browser import chromium_page
from tests.e2e.conftest import Processes, wait_for
from tests.e2e.test_dashboard_session import dashboard_get

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(600)]
DEVICES = 3
KILLED = "dev-0002"


def test_a_killed_agent_shows_as_waiting_then_the_run_finishes(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path
) -> None:
    # Prepare: every coordinator status the broker hands an operator, in order
    statuses: list[CoordinatorStatus] = []
    view, lock = FleetView("default"), threading.Lock()

    def offer(topic: str, payload: bytes) -> None:
        with lock:
            status = view.coordinator if view.offer(topic, payload) else None
            if status is not None and (not statuses or statuses[-1] is not status):
                statuses.append(status)

    def seen(state: str, *, naming: str = "") -> bool:
        with lock:
            return any(s.state == state and naming in (*s.missing, "") for s in statuses)

    watcher = watch_fleet(BrokerSettings(url=mosquitto.url), "default", offer, "test")
    held, reached = threading.Event(), threading.Event()
    lines: list[str] = []
    outcome: list[ServeResult | BaseException] = []
    lingered: list[dict[str, Any]] = []
    settings = ServeSettings.load(
        None,
        broker=mosquitto.url,
        rounds=3,
        min_devices=DEVICES,
        round_timeout=30.0,
        join_timeout=300.0,  # the killed agent's replacement may start slowly on a busy machine
        out=tmp_path / "run",
        checkpoint_dir=tmp_path / "checkpoint",
        dashboard="127.0.0.1:0",
    )

    def on_round(record: RoundRecord) -> None:
        if record.round_id == 1:
            reached.set()
            held.wait(120.0)

    def linger(result: ServeResult) -> None:  # the run is over; its dashboard is still up
        lingered.append(dashboard_get(page_url(), "api/snapshot"))

    def serve() -> None:
        try:
            outcome.append(run_serve(settings, on_round, lines.append, linger=linger))
        except BaseException as error:
            outcome.append(error)

    def page_url() -> str:
        found = [re.search(r"dashboard on (\S+)", line) for line in list(lines)]
        return next((m.group(1) for m in found if m), "")

    thread = threading.Thread(target=serve, daemon=True)
    try:
        thread.start()
        for index in range(DEVICES):
            processes.agent(mosquitto.url, index, shards=DEVICES)
        wait_for(lambda: bool(page_url()) or bool(outcome), "the dashboard's address", 60)
        with chromium_page() as page:
            page.goto(page_url())
            wait_for(lambda: reached.is_set() or bool(outcome), "round 1", 240)
            # Execute: an agent dies without a word while round 1 is held
            processes.running[KILLED].send_signal(signal.SIGKILL)
            held.set()
            # Assert: the status waits for it by name, and so does the page
            wait_for(lambda: seen("waiting", naming=KILLED) or bool(outcome), "waiting", 120)
            assert not outcome, outcome
            page.wait_for_function(
                "() => document.querySelector('#run-state').textContent === 'waiting'",
                timeout=60_000,
            )
            assert KILLED in page.locator("#banner").inner_text()
            # Execute: the device comes back
            processes.agent(mosquitto.url, 2, shards=DEVICES)
            wait_for(lambda: bool(outcome), "serve's end", 300)
    finally:
        held.set()
        thread.join(60.0)
        watcher.close()
    # Assert: the run finished, said so last, and its page outlived it showing the end
    assert isinstance(outcome[0], ServeResult), outcome
    with lock:
        states = [s.state for s in statuses]
        waiting = next(s for s in statuses if s.state == "waiting" and KILLED in s.missing)
    assert states[-1] == "finished", states
    assert states.index("waiting") < len(states) - 1
    assert waiting.deadline is not None
    assert waiting.deadline > waiting.sent_at
    assert waiting.missing_count == len(waiting.missing) >= 1
    assert len(lingered) == 1
    assert lingered[0]["coordinator"]["state"] == "finished"
    assert [r["round_id"] for r in lingered[0]["rounds"]] == [1, 2, 3]
    assert all(r["finished_at"] is not None for r in lingered[0]["rounds"])
    rows = {row["device"]: row for row in lingered[0]["fleet"]}
    assert all(rows[d]["bytes_up"] > 0 and rows[d]["bytes_down"] > 0 for d in rows)
    assert all(rows[d]["round_seconds"] is not None for d in rows)
