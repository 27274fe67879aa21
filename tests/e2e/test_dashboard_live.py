"""The dashboard on a live fleet: serve --dashboard over mosquitto with agent processes.

Its data endpoints follow the run round by round, and in a real headless Chromium the page's
tables and charts update without a reload; a killed agent shows as offline within seconds (its
broker-published last-will), well inside any liveness window.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine.rounds import RoundRecord
from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import ServeSettings
from tests.conftest import Mosquitto
from tests.e2e.browser import chromium_page
from tests.e2e.conftest import Processes

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(420)]
DEVICES = 3


class _TestOverError(Exception):
    """Ends a serve run from its round callback once the test no longer needs it."""


@dataclass
class LiveRun:
    """A serve run in a thread, held after chosen rounds until the test lets it go on."""

    holds: dict[int, threading.Event]
    url: str = ""
    records: list[RoundRecord] = field(default_factory=list)
    result: list[ServeResult | BaseException] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    """Set when the test is over: the run stops after its current round."""

    def release(self, round_id: int) -> None:
        """Let the run go on after `round_id`."""
        self.holds[round_id].set()


@pytest.fixture
def live_run(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path
) -> Iterator[Callable[[int, tuple[int, ...]], LiveRun]]:
    threads: list[threading.Thread] = []
    runs: list[LiveRun] = []

    def start(rounds: int, hold_after: tuple[int, ...]) -> LiveRun:
        run = LiveRun({round_id: threading.Event() for round_id in hold_after})
        runs.append(run)
        lines: list[str] = []
        settings = ServeSettings.load(
            None,
            broker=mosquitto.url,
            rounds=rounds,
            min_devices=DEVICES,
            eval_every=1,
            round_timeout=30.0,
            join_timeout=30.0,  # agents start slowly on a busy machine; a killed one ends the run
            out=tmp_path / "run",
            checkpoint_dir=tmp_path / "checkpoint",
            dashboard="127.0.0.1:0",
        )

        def on_round(record: RoundRecord) -> None:
            run.records.append(record)
            if record.round_id in run.holds:
                run.holds[record.round_id].wait(60.0)
            if run.ended.is_set():  # a killed agent would keep the next round waiting for it
                raise _TestOverError

        def serve() -> None:
            try:
                run.result.append(run_serve(settings, on_round=on_round, notify=lines.append))
            except BaseException as error:
                run.result.append(error)

        thread = threading.Thread(target=serve, daemon=True)
        threads.append(thread)
        thread.start()
        for index in range(DEVICES):
            # a training memory cap and a free-memory condition: the hello's plan and conditions
            budget = ("--memory-budget", "2GB", "--min-free-memory", "1MB")
            processes.agent(mosquitto.url, index, shards=DEVICES, extra=budget)
        deadline = time.monotonic() + 30
        while not run.url and time.monotonic() < deadline and not run.result:
            found = [re.search(r"dashboard on (\S+)", line) for line in lines]
            run.url = next((m.group(1) for m in found if m), "")
            time.sleep(0.05)
        assert run.url, (lines, run.result)
        return run

    yield start
    for run in runs:
        run.ended.set()
        for hold in run.holds.values():
            hold.set()
    for thread in threads:
        thread.join(60.0)


def _snapshot(url: str) -> dict[str, Any]:
    """The snapshot of the dashboard serve printed as `url` (…/?token=…)."""
    base, _, token = url.partition("?token=")
    request = urllib.request.Request(
        f"{base}api/snapshot", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)  # type: ignore[no-any-return]


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    msg = f"timed out waiting for {what}"
    raise AssertionError(msg)


def test_serve_dashboard_data_follows_rounds_and_a_killed_agent_goes_offline(
    live_run: Callable[[int, tuple[int, ...]], LiveRun], processes: Processes
) -> None:
    # Prepare: a three-round run held after round 2
    run = live_run(3, (2,))
    _wait_for(lambda: len(_snapshot(run.url)["rounds"]) == 2, 90, "two rounds on the dashboard")
    snapshot = _snapshot(run.url)
    # Assert: the rounds so far, every device online with its rounds, the run's settings
    assert [r["round_id"] for r in snapshot["rounds"]] == [1, 2]
    assert all(r["selected"] == DEVICES == r["participants"] for r in snapshot["rounds"])
    assert snapshot["rounds"][-1]["evaluation"]["personalized_mean"] is not None
    assert snapshot["coordinator"]["state"] == "running"
    assert snapshot["settings"]["rounds"] == 3
    assert snapshot["settings"]["task"] == "digits"
    rows = {row["device"]: row for row in snapshot["fleet"]}
    assert sorted(rows) == ["dev-0000", "dev-0001", "dev-0002"]
    assert all(row["online"] and row["rounds_taken"] == 2 for row in rows.values())
    for row in rows.values():  # from the hellos
        assert row["memory_plan"]["budget_bytes"] > 0
        assert row["eligibility"]["min_free_memory_bytes"] > 0
    assert len(snapshot["devices"]) == DEVICES
    # Execute: an agent dies without a word
    killed_at = time.monotonic()
    processes.running["dev-0002"].send_signal(signal.SIGKILL)
    _wait_for(
        lambda: not {r["device"]: r for r in _snapshot(run.url)["fleet"]}["dev-0002"]["online"],
        15,
        "dev-0002 offline",
    )
    # Assert: offline within seconds, the others still online
    assert time.monotonic() - killed_at < 15
    rows = {row["device"]: row for row in _snapshot(run.url)["fleet"]}
    assert rows["dev-0000"]["online"]
    assert rows["dev-0001"]["online"]


def test_the_page_updates_without_a_reload_in_headless_chromium(
    live_run: Callable[[int, tuple[int, ...]], LiveRun], processes: Processes, tmp_path: Path
) -> None:
    run = live_run(4, (1, 3))
    with chromium_page() as page:
        # Prepare: the page open while round 1 is held
        page.goto(run.url)
        _wait_for(lambda: len(run.records) == 1 or bool(run.result), 180, "round 1")
        assert len(run.records) == 1, run.result
        page.wait_for_function(
            "() => document.querySelectorAll('#rounds tbody tr').length === 1", timeout=20_000
        )
        page.evaluate("window.__sameDocument = true")
        renders = page.evaluate("window.pflDashboard.renders")
        assert page.locator("#connection").inner_text() == "live"
        # Execute: the run goes on to round 3; then an agent dies
        run.release(1)
        page.wait_for_function(
            "() => document.querySelectorAll('#rounds tbody tr').length === 3", timeout=90_000
        )
        processes.running["dev-0001"].send_signal(signal.SIGKILL)
        page.wait_for_function(
            "() => document.querySelector('#fleet tr[data-device=\"dev-0001\"] td.online')"
            ".textContent.includes('offline')",
            timeout=15_000,
        )
        # Assert: the same document all along, re-rendered from pushed snapshots
        assert page.evaluate("window.__sameDocument") is True
        assert page.evaluate("window.pflDashboard.renders") > renders
        online = page.locator("#fleet tr[data-device='dev-0000'] td.online").inner_text()
        assert "online" in online
        # the charts hold every round so far (uPlot's data, x = round ids)
        points = page.evaluate("window.pflDashboard.charts['chart-loss'].data[0].length")
        assert points >= 3
        assert page.locator("#run-title").inner_text().startswith("default · digits")
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)


def test_the_page_shows_the_run_finished_before_serve_stops_its_dashboard(
    live_run: Callable[[int, tuple[int, ...]], LiveRun],
) -> None:
    run = live_run(2, (1,))
    with chromium_page(width=400) as page:
        # Prepare: the page open while round 1 is held
        page.goto(run.url)
        page.wait_for_function(
            "() => document.querySelectorAll('#rounds tbody tr').length === 1", timeout=180_000
        )
        assert page.locator("#run-state").inner_text() == "running"
        # Execute: the run goes on to its end; serve stops its dashboard with it
        run.release(1)
        page.wait_for_function("() => document.body.dataset.state === 'finished'", timeout=180_000)
        # Assert: the last change arrived before the server went
        assert page.locator("#run-progress").inner_text() == "round 2 of 2"
        page.wait_for_function(
            "() => document.querySelector('#connection').textContent === 'run over, server gone'",
            timeout=60_000,
        )
        overflow = page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
    _wait_for(lambda: bool(run.result), 120, "serve's end")
    assert isinstance(run.result[0], ServeResult), run.result
