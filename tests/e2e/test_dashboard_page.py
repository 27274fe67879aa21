"""The dashboard's page in a real headless Chromium, fed by a board the test drives.

At a desktop width and at 400 px: nothing overflows sideways; the fleet table sorts, filters and
searches, draws only the rows in view, keeps a selection and a chart's zoom across updates; a DP
run's epsilon and its finished state show, and the states the coordinator may publish
(waiting, stalled, stopped) are spelled out.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from coordinator.dashboard.board import Board
from coordinator.dashboard.history import RunHistoryLog
from coordinator.dashboard.launch import run_directory_dashboard
from coordinator.dashboard.server import DashboardServer, Listen
from coordinator.dashboard.settings import DashboardSettings
from coordinator.engine.round_types import RoundRecord
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols.messages import CoordinatorStatus, EvaluationReport, FleetDevice, FleetStatus
from tests.e2e.browser import chromium_page

pytestmark = pytest.mark.timeout(300)
DEVICES = 400
WIDTHS = (1400, 400)
UI_WAIT_MS = 30_000
"""A generous ceiling for the page to show what it was sent (a busy machine is slow)."""


def _fleet(round_id: int, offline: frozenset[int] = frozenset()) -> FleetStatus:
    return FleetStatus(
        fleet="default",
        round_id=round_id,
        devices=tuple(
            FleetDevice(
                device_id=f"dev-{i:04d}",
                online=i % 10 != 3 and i not in offline,
                last_seen=1000.0 + i,
                rounds_taken=i % 7,
                quarantined=i % 50 == 5,
                declines=2 if i % 25 == 1 else 0,
                last_decline="on battery" if i % 25 == 1 else "",
                num_train_samples=50 + i,
            )
            for i in range(DEVICES)
        ),
    )


def _history(rounds: int) -> RunHistoryLog:
    history = RunHistoryLog("default", {"task": "digits", "algorithm": "fedavg", "rounds": 9})
    for round_id in range(1, rounds + 1):
        history.add_round(
            RoundRecord(
                round_id, DEVICES, DEVICES - 40, 1.0 / round_id, 10**5, 10**5, 0.5,
                evaluation={"personalized_mean": 0.5 + round_id / 100, "global": 0.5},
            )
        )  # fmt: skip
    history.add_evaluations(
        EvaluationReport(
            run_id="ab" * 16, round_id=1, device_id=f"dev-{i:04d}", metric_name="accuracy",
            personalized=0.6 + (i % 13) / 100, global_model=0.6, num_test_samples=10,
            num_train_samples=50 + i,
        )
        for i in range(DEVICES)
    )  # fmt: skip
    return history


@pytest.fixture
def fed() -> Iterator[tuple[DashboardServer, Board]]:
    board = Board("test fleet", "default")
    board.apply(CoordinatorStatus(state="running", fleet="default", round_id=3, rounds=9))
    board.apply(_fleet(3))
    board.apply(_history(3).message("ab" * 16))
    with DashboardServer(board, Listen("127.0.0.1", 0), open_to_local_users=True) as server:
        yield server, board


def _no_sideways_overflow(page: Page) -> None:
    widths = page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert widths[0] <= widths[1], widths


def _visible_devices(page: Page) -> list[str]:
    found = page.eval_on_selector_all(
        "#fleet tbody tr[data-device]", "rows => rows.map(r => r.dataset.device)"
    )
    return [str(device) for device in found]


def _open(page: Page, url: str, version: int) -> None:
    page.goto(url)
    page.wait_for_function(
        f"() => Number(document.body.dataset.version) >= {version}", timeout=UI_WAIT_MS
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_the_fleet_table_sorts_filters_and_searches_without_sideways_overflow(
    fed: tuple[DashboardServer, Board], width: int
) -> None:
    server, board = fed
    with chromium_page(width=width, height=900) as page:
        _open(page, server.url, board.version)
        _no_sideways_overflow(page)
        # only the rows in view are drawn, however many devices there are
        drawn = _visible_devices(page)
        assert 0 < len(drawn) < 80
        # the default order: devices needing attention first (quarantined, offline, declining)
        first = page.evaluate(
            "id => pflDashboard.snapshot.fleet.find(d => d.device === id)", drawn[0]
        )
        assert first["quarantined"] or not first["online"]
        # sort by device, both ways
        page.click("#fleet-head th[data-key=device]")
        assert _visible_devices(page)[:3] == ["dev-0000", "dev-0001", "dev-0002"]
        page.click("#fleet-head th[data-key=device]")
        assert _visible_devices(page)[0] == f"dev-{DEVICES - 1:04d}"
        # filters: offline only, declining only
        page.select_option("#fleet-filter", "offline")
        offline = page.eval_on_selector_all(
            "#fleet tbody tr[data-device] td.online", "cells => cells.map(c => c.textContent)"
        )
        assert offline
        assert set(offline) == {"offline"}
        assert page.locator("#fleet-shown").inner_text() == f"40 of {DEVICES} shown"
        page.select_option("#fleet-filter", "declining")
        declining = _visible_devices(page)
        assert declining
        assert all(int(d[4:]) % 25 == 1 for d in declining)
        # search within every device
        page.select_option("#fleet-filter", "all")
        page.fill("#fleet-search", "dev-0123")
        assert _visible_devices(page) == ["dev-0123"]
        page.fill("#fleet-search", "")
        # scrolling draws the rows that come into view
        page.click("#fleet-head th[data-key=device]")
        page.eval_on_selector("#fleet-wrap", "wrap => { wrap.scrollTop = wrap.scrollHeight; }")
        page.wait_for_function(
            f"() => [...document.querySelectorAll('#fleet tbody tr[data-device]')]"
            f".some(r => r.dataset.device === 'dev-{DEVICES - 1:04d}')",
            timeout=UI_WAIT_MS,
        )
        _no_sideways_overflow(page)


def test_a_selection_and_a_zoom_survive_updates_and_devices_are_named(
    fed: tuple[DashboardServer, Board],
) -> None:
    server, board = fed
    with chromium_page() as page:
        _open(page, server.url, board.version)
        # select a row (sorted by id), zoom the metric chart by dragging over it
        page.click("#fleet-head th[data-key=device]")
        page.click("#fleet tbody tr[data-device='dev-0001']")
        assert page.locator("#device-detail").inner_text().count("on battery") == 1
        page.locator("#chart-metric").scroll_into_view_if_needed()
        box = page.locator("#chart-metric .u-over").bounding_box()
        assert box is not None
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + 5, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] / 2, y, steps=5)
        page.mouse.up()
        zoomed = page.evaluate("pflDashboard.charts['chart-metric'].scales.x.max")
        assert zoomed < 3  # of rounds 1..3
        # Execute: the run goes on (a round, a device goes offline), pushed as a delta
        renders = page.evaluate("pflDashboard.renders")
        board.apply(_fleet(4, offline=frozenset({1})))
        board.apply(_history(4).message("ab" * 16))
        page.wait_for_function(
            f"() => pflDashboard.snapshot.rounds.length === 4 && pflDashboard.renders > {renders}",
            timeout=UI_WAIT_MS,
        )
        # Assert: the same row selected and updated in place, the zoom kept, the latest shown
        selected = page.locator("#fleet tbody tr.selected")
        assert selected.get_attribute("data-device") == "dev-0001"
        assert selected.locator("td.online").inner_text() == "offline"
        assert page.evaluate("pflDashboard.charts['chart-metric'].scales.x.max") == zoomed
        assert "personalized 0.540" in page.locator("#latest-metric").inner_text()
        assert "dev-0001 went offline" in page.locator("#events").inner_text()
        # hovering the gain chart names the device under the cursor
        page.locator("#chart-gain").scroll_into_view_if_needed()
        gain = page.locator("#chart-gain .u-over").bounding_box()
        assert gain is not None
        page.mouse.move(gain["x"] + gain["width"] / 2, gain["y"] + gain["height"] / 2)
        page.wait_for_function(
            "() => document.querySelector('#gain-hover').textContent.includes('dev-')",
            timeout=UI_WAIT_MS,
        )
        # CSV of the fleet as filtered
        page.select_option("#fleet-filter", "offline")
        with page.expect_download() as download:
            page.click("#csv-fleet")
        lines = Path(download.value.path()).read_text().splitlines()
        assert lines[0].startswith("device,online,")
        assert len(lines) == 1 + 41
        assert all(",offline," in line for line in lines[1:])


def _render_with(page: Page, changes: dict[str, Any]) -> str:
    """Render the page's snapshot with `changes` (as a newer version); the banner's text."""
    page.evaluate(
        "c => render({...pflDashboard.snapshot, ...c, version: pflDashboard.snapshot.version + 1})",
        changes,
    )
    return page.locator("#banner").inner_text()


def _with_coordinator(page: Page, coordinator: dict[str, Any]) -> str:
    """Render the page's snapshot as if the coordinator published `coordinator`; the banner."""
    return _render_with(page, {"coordinator": coordinator})


def test_states_the_coordinator_may_publish_are_spelled_out(
    fed: tuple[DashboardServer, Board],
) -> None:
    server, board = fed
    base = {"kind": "coordinator-status", "fleet": "default", "round_id": 3, "rounds": 9}
    with chromium_page(width=400) as page:
        _open(page, server.url, board.version)
        assert page.locator("#banner").is_hidden()
        now = page.evaluate("pflDashboard.snapshot.now")
        banner = _with_coordinator(
            page,
            {**base, "state": "waiting", "missing": ["dev-0003", "dev-0013"], "deadline": now + 95},
        )
        assert banner.startswith("waiting for 2 device(s): dev-0003, dev-0013")
        assert "min left" in banner or "s left" in banner
        assert page.locator("#run-state").inner_text() == "waiting"
        banner = _with_coordinator(
            page, {**base, "state": "stalled", "reason": "no update in 5 min"}
        )
        assert banner == "stalled: no update in 5 min"
        banner = _with_coordinator(
            page, {**base, "state": "stopped", "reason": "interrupted at round 3 (--resume)"}
        )
        assert banner == "interrupted at round 3 (--resume)"
        assert page.locator("#run-state").inner_text() == "stopped"
        events = [{"at": now, "level": "warn", "text": "dev-0003 has not answered"}]
        _with_coordinator(page, {**base, "state": "running", "events": events})
        assert "dev-0003 has not answered" in page.locator("#events").inner_text()
        assert page.locator("#banner").is_hidden()
        # running, but no round ended for far longer than the round timeout: called out
        page.evaluate("pflDashboard.lastRoundAt -= 200")
        settings = {**page.evaluate("pflDashboard.snapshot.settings"), "round_timeout": 30.0}
        banner = _render_with(page, {"settings": settings})
        assert banner.startswith("no round has ended for 3 min (round timeout 30 s)")
        _no_sideways_overflow(page)


def test_the_x_axis_may_be_clock_time(fed: tuple[DashboardServer, Board]) -> None:
    server, board = fed
    with chromium_page() as page:
        _open(page, server.url, board.version)
        assert page.evaluate("pflDashboard.charts['chart-loss'].data[0]") == [1, 2, 3]
        page.select_option("#x-axis", "time")
        # no end times in these rounds: the run's elapsed seconds (0.5 s wall time each)
        assert page.evaluate("pflDashboard.charts['chart-loss'].data[0]") == [0.5, 1.0, 1.5]
        rounds = page.evaluate("pflDashboard.snapshot.rounds")
        ended = [{**r, "finished_at": 1.7e9 + 60 * r["round_id"]} for r in rounds]
        _render_with(page, {"rounds": ended})
        assert page.evaluate("pflDashboard.charts['chart-loss'].data[0]") == [
            1.7e9 + 60,
            1.7e9 + 120,
            1.7e9 + 180,
        ]
        assert page.evaluate("pflDashboard.charts['chart-loss'].scales.x.time") is True
        # and the rounds as CSV, evaluations included
        with page.expect_download() as download:
            page.click("#csv-rounds")
        lines = Path(download.value.path()).read_text().splitlines()
        assert lines[0].split(",")[:3] == ["round_id", "selected", "participants"]
        assert "personalized_mean" in lines[0]
        assert len(lines) == 4


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp") / "run"
    settings = SimulationSettings.load(
        None, algorithm="fedavg", devices=4, rounds=3, eval_every=1, dp_noise=1.0, out=out
    )
    run_simulation(settings)
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_a_finished_dp_run_shows_epsilon_its_final_cards_and_no_empty_loss(
    dp_run: Path, width: int
) -> None:
    summary = json.loads((dp_run / "summary.json").read_text())
    settings = DashboardSettings(listen="127.0.0.1:0", open_to_local_users=True)
    with run_directory_dashboard(settings, dp_run) as server, chromium_page(width=width) as page:
        page.goto(server.url)
        page.wait_for_function(
            "() => document.body.dataset.state === 'finished'", timeout=UI_WAIT_MS
        )
        assert page.locator("#run-state").inner_text() == "finished"
        assert page.locator("#card-privacy").is_visible()
        spent = page.locator("#card-epsilon").inner_text()
        assert spent.startswith(f"{summary['privacy']['epsilon']:.2f} / ")
        assert page.locator("#privacy-figure").is_visible()
        points = page.evaluate("pflDashboard.charts['chart-epsilon'].data[1]")
        assert points[-1] == pytest.approx(summary["privacy"]["epsilon"])
        personalized = summary["metrics"]["personalized_mean"]
        assert page.locator("#card-personalized").inner_text() == f"{personalized:.3f}"
        assert page.locator("#card-metric-label").inner_text().startswith("final ")
        losses = [r["train_loss"] for r in page.evaluate("pflDashboard.snapshot.rounds")]
        assert not any(losses)  # devices send no loss under DP: said so, not an empty chart
        assert page.locator("#loss-absent").is_visible()
        assert "not reported under DP" in page.locator("#loss-absent").inner_text()
        assert page.locator("#chart-loss").is_hidden()
        cells = page.eval_on_selector_all(
            "#fleet tbody tr[data-device]", "rows => rows.map(r => r.children[6].textContent)"
        )
        assert cells
        assert set(cells) == {"n/r (DP)"}
        # only the settings in use: DP's are, secure aggregation's and async's are not
        shown = page.eval_on_selector_all("#settings dt", "d => d.map(e => e.textContent)")
        assert "dp_noise" in shown
        assert not [k for k in shown if k.startswith(("secagg", "buffer", "max_staleness"))]
        _no_sideways_overflow(page)


def test_another_run_beside_this_one_is_drawn_over_its_metric(dp_run: Path, tmp_path: Path) -> None:
    for name in ("a", "b"):
        shutil.copytree(dp_run, tmp_path / name)
    settings = DashboardSettings(listen="127.0.0.1:0", open_to_local_users=True)
    with (
        run_directory_dashboard(settings, tmp_path / "a") as server,
        chromium_page() as page,
    ):
        page.goto(server.url)
        page.wait_for_function(
            "() => document.body.dataset.state === 'finished'", timeout=UI_WAIT_MS
        )
        page.wait_for_function(
            "() => !document.querySelector('#overlay-controls').hidden", timeout=UI_WAIT_MS
        )
        page.select_option("#overlay-run", "b")
        page.wait_for_function(
            "() => pflDashboard.charts['chart-metric'].series.length === 5", timeout=UI_WAIT_MS
        )
        labels = page.evaluate("pflDashboard.charts['chart-metric'].series.map(s => s.label)")
        assert labels[-1] == "b: personalized"
        data = page.evaluate("pflDashboard.charts['chart-metric'].data")
        ours, theirs = data[1], data[4]
        assert ours == theirs  # the same run copied: the same curve
        assert any(v is not None for v in theirs)


def test_a_run_stopped_at_its_privacy_budget_says_why(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_simulation(
        SimulationSettings.load(
            None, algorithm="fedavg", devices=4, rounds=3, dp_noise=1.0, dp_epsilon=6.0, out=out
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    released = summary["privacy"]["rounds_released"]
    assert released < 3  # the budget stopped it
    settings = DashboardSettings(listen="127.0.0.1:0", open_to_local_users=True)
    with run_directory_dashboard(settings, out) as server, chromium_page() as page:
        page.goto(server.url)
        page.wait_for_function(
            "() => document.body.dataset.state === 'finished'", timeout=UI_WAIT_MS
        )
        banner = page.locator("#banner").inner_text()
        assert banner.startswith(f"stopped after round {released} of 3: another round would pass")
        assert "of 6.00 spent" in banner
        assert page.locator("#card-epsilon").inner_text().endswith(" / 6.00")


def test_per_device_points_are_binned_at_scale(fed: tuple[DashboardServer, Board]) -> None:
    server, board = fed
    with chromium_page() as page:
        _open(page, server.url, board.version)
        assert len(page.evaluate("pflDashboard.charts['chart-gain'].data[0]")) == DEVICES
        many = [
            {
                "device_id": f"dev-{i:05d}",
                "round_id": 1,
                "metric_name": "accuracy",
                "personalized": 0.5 + (i % 7) / 100,
                "global_model": 0.5,
                "num_train_samples": 10 + i,
            }
            for i in range(3000)
        ]
        _render_with(page, {"devices": many})
        xs = page.evaluate("pflDashboard.charts['chart-gain'].data[0]")
        assert 0 < len(xs) <= 300
        assert xs == sorted(xs)
        label = page.evaluate("pflDashboard.charts['chart-gain'].series[1].label")
        assert label == "device gain (binned means)"
        names = page.evaluate("charts.gainNames")
        assert names[0] == "10 devices, dev-00000 … dev-00009 (mean)"
