"""The dashboard's traffic and its headers.

Gzip, deltas, security headers, the session cookie, a run directory waited for, sibling runs
for the overlay, final cards from summary.json.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import pytest

from coordinator.dashboard.board import Board
from coordinator.dashboard.feeds import ViewTap
from coordinator.dashboard.gate import COOKIE, session_value
from coordinator.dashboard.launch import run_directory_dashboard
from coordinator.dashboard.server import DashboardServer, Listen
from coordinator.dashboard.settings import DashboardSettings
from coordinator.dashboard.stream import KEYED_LISTS, accepts_gzip, snapshot_delta
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols import topics
from protocols.codec import encode_frame
from protocols.messages import CoordinatorStatus, DeviceStatus, FleetDevice, FleetStatus
from protocols.transport.inprocess import InProcessBroker

LOOPBACK = Listen("127.0.0.1", 0)
TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _open(url: str, headers: dict[str, str] | None = None, opener: Any = None) -> Any:
    opener = opener or urllib.request.build_opener()
    return opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30)


def _fleet(count: int, offline: frozenset[int] = frozenset()) -> FleetStatus:
    devices = tuple(
        FleetDevice(device_id=f"dev-{i:05d}", online=i not in offline, last_seen=1.0)
        for i in range(count)
    )
    return FleetStatus(fleet="default", round_id=1, devices=devices)


def _apply(before: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """What the page does with a delta (dashboard.js applyDelta), in Python."""
    after = {**before, **delta["set"]}
    for key in delta["unset"]:
        del after[key]
    for name, change in delta["lists"].items():
        ident = KEYED_LISTS[name]
        rows = {row[ident]: row for row in after[name]}
        for gone in change["remove"]:
            del rows[gone]
        rows.update({row[ident]: row for row in change["upsert"]})
        after[name] = [rows[key] for key in sorted(rows)]
    return after


@pytest.fixture
def server() -> Iterator[tuple[DashboardServer, Board]]:
    board = Board("test")
    board.apply(_fleet(500))
    with DashboardServer(board, LOOPBACK, token=TOKEN) as running:
        yield running, board


def _base(server: DashboardServer) -> str:
    return server.url.split("?")[0]


def test_a_delta_carries_only_what_changed_and_rebuilds_the_snapshot() -> None:
    board = Board("test")
    board.apply(_fleet(300))
    _, before = board.state()
    board.apply(_fleet(300, offline=frozenset({7})))
    board.apply(DeviceStatus(device_id="dev-99999", state="online"))
    _, after = board.state()
    delta = snapshot_delta(before, after)
    assert [row["device"] for row in delta["lists"]["fleet"]["upsert"]] == [
        "dev-00007",
        "dev-99999",
    ]
    assert delta["lists"]["fleet"]["remove"] == []
    assert "fleet" not in delta["set"]
    assert delta["set"]["version"] == after["version"]
    assert _apply(before, delta) == after
    # a device gone from the view is removed by id
    shrunk = {**after, "fleet": after["fleet"][1:]}
    assert snapshot_delta(after, shrunk)["lists"]["fleet"] == {
        "upsert": [],
        "remove": ["dev-00000"],
    }
    assert len(json.dumps(delta)) * 20 < len(json.dumps(after))


@pytest.mark.parametrize(
    ("header", "accepted"),
    [("gzip, deflate, br", True), ("br", False), ("", False), ("gzip;q=0", False), ("*", True)],
)
def test_gzip_is_used_only_when_the_browser_accepts_it(header: str, accepted: bool) -> None:
    assert accepts_gzip(header) is accepted


def test_the_snapshot_is_gzipped_for_a_browser_that_accepts_it(
    server: tuple[DashboardServer, Board],
) -> None:
    running, _ = server
    url = f"{_base(running)}api/snapshot"
    with _open(url, AUTH) as plain:
        assert plain.headers.get("Content-Encoding") is None
        text = json.load(plain)
    with _open(url, {**AUTH, "Accept-Encoding": "gzip"}) as packed:
        assert packed.headers["Content-Encoding"] == "gzip"
        assert packed.headers["Vary"] == "Accept-Encoding"
        body = packed.read()
    unpacked = json.loads(zlib.decompress(body, 31))
    assert unpacked["fleet"] == text["fleet"]
    assert len(body) * 5 < len(json.dumps(text))


def test_the_event_stream_is_one_gzip_stream_of_a_snapshot_then_deltas(
    server: tuple[DashboardServer, Board],
) -> None:
    running, board = server
    events: list[tuple[str, dict[str, Any]]] = []
    wire: list[int] = []
    done = threading.Event()

    def read() -> None:
        headers = {**AUTH, "Accept-Encoding": "gzip"}
        with _open(f"{_base(running)}api/events", headers) as stream:
            assert stream.headers["Content-Encoding"] == "gzip"
            inflate, text = zlib.decompressobj(31), ""
            while len(events) < 2:
                chunk = stream.read1(65536)
                wire.append(len(chunk))
                text += inflate.decompress(chunk).decode()
                while "\n\n" in text:
                    block, text = text.split("\n\n", 1)
                    lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
                    if "event" in lines:
                        events.append((lines["event"], json.loads(lines["data"])))
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for _ in range(600):  # the first snapshot, then a change
        if events:
            break
        done.wait(0.05)
    board.apply(_fleet(500, offline=frozenset({3})))
    assert done.wait(30.0)
    (first, snapshot), (second, delta) = events
    assert (first, second) == ("snapshot", "delta")
    assert len(snapshot["fleet"]) == 500
    assert [row["device"] for row in delta["lists"]["fleet"]["upsert"]] == ["dev-00003"]
    assert not delta["lists"]["fleet"]["upsert"][0]["online"]
    assert sum(wire) * 5 < len(json.dumps(snapshot))


@pytest.mark.parametrize("path", ["", "api/snapshot", "static/dashboard.js", "healthz"])
def test_every_answer_carries_the_security_headers(
    server: tuple[DashboardServer, Board], path: str
) -> None:
    running, _ = server
    with _open(f"{_base(running)}{path}", AUTH) as response:
        headers = response.headers
    csp = headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert "script-src 'self'" in csp
    assert "unsafe-inline" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "no-referrer"


def test_refusals_carry_the_security_headers_too(server: tuple[DashboardServer, Board]) -> None:
    running, _ = server
    with pytest.raises(urllib.error.HTTPError) as refused:
        _open(f"{_base(running)}api/snapshot")
    assert refused.value.code == 401
    assert refused.value.headers["X-Frame-Options"] == "DENY"


def test_the_session_cookie_is_derived_from_the_token_and_is_not_a_bearer(
    server: tuple[DashboardServer, Board],
) -> None:
    running, _ = server
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with _open(running.url, opener=opener) as page:
        assert page.url == _base(running)
    (cookie,) = list(jar)
    assert cookie.name == COOKIE
    assert cookie.value == session_value(TOKEN)
    assert TOKEN not in (cookie.value or "")
    assert session_value(TOKEN) != session_value(TOKEN + "x")
    with _open(f"{_base(running)}api/snapshot", opener=opener) as ok:
        assert json.load(ok)["source"] == "test"
    # what a stolen cookie gives is no token: it opens no other dashboard, nor works as one
    with pytest.raises(urllib.error.HTTPError) as refused:
        _open(f"{_base(running)}api/snapshot", {"Authorization": f"Bearer {cookie.value}"})
    assert refused.value.code == 401
    forged = {"Cookie": f"{COOKIE}={TOKEN}"}
    with pytest.raises(urllib.error.HTTPError):
        _open(f"{_base(running)}api/snapshot", forged)


@pytest.fixture(scope="module")
def finished_dp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "dp"
    settings = SimulationSettings.load(
        None,
        algorithm="fedavg",
        devices=4,
        rounds=2,
        eval_every=1,
        dp_noise=1.0,
        dp_epsilon=50.0,
        out=out,
    )
    run_simulation(settings)
    return out


def test_a_missing_run_directory_is_waited_for_then_followed(
    tmp_path: Path, finished_dp_run: Path
) -> None:
    later = tmp_path / "later"
    said: list[str] = []
    settings = DashboardSettings(listen="127.0.0.1:0", open_to_local_users=True)
    with run_directory_dashboard(settings, later, said.append) as running:
        url = f"{running.url}api/snapshot"
        with _open(url) as response:
            waiting = json.load(response)
        assert "waiting for" in waiting["notice"]
        assert waiting["rounds"] == []
        assert any("waiting for" in line for line in said)
        shutil.copytree(finished_dp_run, later)
        found: dict[str, Any] = {}
        for _ in range(600):  # the feed looks twice a second
            with _open(url) as response:
                found = json.load(response)
            if found["finished"]:
                break
            threading.Event().wait(0.05)
    assert found["finished"]
    assert found["notice"] == ""
    assert [r["round_id"] for r in found["rounds"]] == [1, 2]


def test_a_finished_dp_runs_snapshot_has_its_summary_and_epsilon(finished_dp_run: Path) -> None:
    settings = DashboardSettings(listen="127.0.0.1:0", open_to_local_users=True)
    with (
        run_directory_dashboard(settings, finished_dp_run) as running,
        _open(f"{running.url}api/snapshot") as response,
    ):
        snapshot = json.load(response)
    summary = json.loads((finished_dp_run / "summary.json").read_text())
    assert snapshot["summary"]["metrics"] == summary["metrics"]
    assert snapshot["summary"]["privacy"]["epsilon"] == summary["privacy"]["epsilon"] > 0
    assert "config" not in snapshot["summary"]
    spent = [r["scalars"]["dp_epsilon"] for r in snapshot["rounds"]]
    assert spent == sorted(spent)
    assert spent[-1] > 0
    assert snapshot["settings"]["dp_epsilon"] == 50.0


def test_sibling_runs_are_listed_for_the_overlay(tmp_path: Path, finished_dp_run: Path) -> None:
    root = tmp_path / "runs"
    for name in ("a", "b"):
        shutil.copytree(finished_dp_run, root / name)
    (root / "not-a-run").mkdir()
    settings = DashboardSettings(listen="127.0.0.1:0", open_to_local_users=True)
    with run_directory_dashboard(settings, root / "a") as running:
        with _open(f"{running.url}api/runs") as response:
            assert json.load(response) == {"runs": ["b"]}
        with _open(f"{running.url}api/runs/b") as response:
            assert [r["round_id"] for r in json.load(response)["rounds"]] == [1, 2]
        for name in ("not-a-run", "..", "a"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _open(f"{running.url}api/runs/{name}")
            assert refused.value.code == 404


def test_stopping_lets_an_open_page_get_the_last_change_first() -> None:
    board = Board("test")
    board.apply(_fleet(10))
    events: list[dict[str, Any]] = []
    server = DashboardServer(board, LOOPBACK, token=TOKEN).start()

    def read() -> None:
        with _open(f"{_base(server)}api/events", AUTH) as stream:
            for raw in stream:
                line = raw.decode()
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for _ in range(600):  # the first snapshot arrived
        if events:
            break
        threading.Event().wait(0.05)
    # Execute: the run's last change, and the server stopped right after it
    board.apply(CoordinatorStatus(state="finished", fleet="default", round_id=9, rounds=9))
    server.stop()
    reader.join(30.0)
    # Assert: the page got it before its stream ended
    assert not reader.is_alive()
    assert events[-1]["set"]["coordinator"]["state"] == "finished"
    assert events[-1]["set"]["version"] == board.version


def test_leaving_the_view_tap_hands_the_board_what_is_still_filed() -> None:
    broker = InProcessBroker()
    board = Board("serve", "default")
    status = CoordinatorStatus(state="finished", fleet="default", round_id=3, rounds=3)
    for _ in range(20):  # whatever the feed thread's timing
        with ViewTap(broker.connect("pfl-coord-default"), "default", board.offer) as engine:
            engine.publish(topics.coordinator_status("default"), encode_frame(status))
        assert board.snapshot()["coordinator"]["state"] == "finished"
        board.apply(CoordinatorStatus(state="running", fleet="default"))
