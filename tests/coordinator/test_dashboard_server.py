"""The dashboard's HTTP side on a real server: data endpoints, the event stream, token and TLS."""

from __future__ import annotations

import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import pytest

from coordinator.dashboard.board import Board
from coordinator.dashboard.launch import run_directory_dashboard
from coordinator.dashboard.server import DashboardServer, Listen
from coordinator.dashboard.settings import DashboardSettings
from coordinator.ops.provision import provision
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from protocols.messages import CoordinatorStatus, DeviceStatus

LOOPBACK = Listen("127.0.0.1", 0)


def _get(
    url: str,
    opener: urllib.request.OpenerDirector | None = None,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> Any:
    if opener is None:
        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
    return opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10)


def _base(server: DashboardServer) -> str:
    return server.url.split("?")[0]


def _bearer(server: DashboardServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def _read_events(url: str, found: list[dict[str, Any]], count: int, token: str) -> None:
    """Append the events the stream pushes as they come (`event` names each), until `count`."""
    with _get(url, headers={"Authorization": f"Bearer {token}"}) as stream:
        name = ""
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            if line.startswith("data: "):
                found.append({"event": name, **json.loads(line[6:])})
                if len(found) >= count:
                    return


def _until(condition: Any, timeout_s: float = 10.0) -> bool:
    waiting = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        waiting.wait(0.05)
    return bool(condition())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    run_simulation(
        SimulationSettings.load(
            None, algorithm="fedalt", devices=4, rounds=2, eval_every=1, out=out
        )
    )
    return out


@pytest.fixture
def served_run(finished_run: Path) -> Iterator[DashboardServer]:
    settings = DashboardSettings(listen="127.0.0.1:0")
    with run_directory_dashboard(settings, finished_run) as server:
        yield server


def test_a_finished_runs_snapshot_has_its_rounds_devices_and_settings(
    served_run: DashboardServer,
) -> None:
    base, auth = _base(served_run), _bearer(served_run)
    with _get(f"{base}api/snapshot", headers=auth) as response:
        snapshot = json.load(response)
    assert snapshot["finished"]
    assert snapshot["coordinator"]["state"] == "finished"
    assert [r["round_id"] for r in snapshot["rounds"]] == [1, 2]
    assert all(r["participants"] == 4 for r in snapshot["rounds"])
    assert snapshot["rounds"][-1]["evaluation"]["personalized_mean"] > 0
    assert sorted(d["device_id"] for d in snapshot["devices"]) == [f"dev-000{i}" for i in range(4)]
    assert [row["rounds_taken"] for row in snapshot["fleet"]] == [2, 2, 2, 2]
    assert snapshot["settings"]["algorithm"] == "fedalt"
    # the page and its charting library come from the package, never a CDN
    with _get(base, headers=auth) as page:
        html = page.read().decode()
    assert 'src="static/uPlot.iife.min.js"' in html
    assert "http" not in html.split("<body>")[1]
    with _get(f"{base}static/uPlot.iife.min.js") as library:
        assert len(library.read()) > 10_000


def test_the_event_stream_pushes_a_snapshot_when_the_board_changes() -> None:
    board = Board("test")
    with DashboardServer(board, LOOPBACK) as server:
        pushed: list[dict[str, Any]] = []
        reader = threading.Thread(
            target=_read_events,
            args=(f"{_base(server)}api/events", pushed, 2, server.token),
            daemon=True,
        )
        reader.start()
        assert _until(lambda: len(pushed) == 1)  # the current snapshot comes at once
        board.apply(CoordinatorStatus(state="running", fleet="default", round_id=3, rounds=9))
        reader.join(20.0)
    assert [p["event"] for p in pushed] == ["snapshot", "delta"]
    assert pushed[0]["version"] == 0
    assert pushed[1]["set"]["version"] == 1
    assert pushed[1]["set"]["coordinator"]["round_id"] == 3


def test_off_loopback_a_token_is_made_up_and_every_data_path_asks_for_it() -> None:
    # A token is made up when none is given, off loopback and on it (bound here on loopback
    # with one given, since tests never listen beyond 127.0.0.1)
    assert DashboardServer(Board("x"), Listen("0.0.0.0", 0)).token
    assert DashboardServer(Board("x"), LOOPBACK).token
    board = Board("test")
    board.apply(DeviceStatus(device_id="dev-0000", state="online"))
    with DashboardServer(board, LOOPBACK, token="s3cret-token") as server:
        base = server.url.split("?")[0]
        for path in ("", "api/snapshot", "api/events"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _get(f"{base}{path}")
            assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            _get(f"{base}api/snapshot", headers={"Authorization": "Bearer wrong"})
        # a bearer header works; the link with ?token= sets a cookie and drops the token
        with _get(f"{base}api/snapshot", headers={"Authorization": "Bearer s3cret-token"}) as ok:
            assert json.load(ok)["fleet"][0]["device"] == "dev-0000"
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with _get(server.url, opener) as page:
            assert page.url == base  # redirected to the page without the token
            assert "pfl-edge" in page.read().decode()
        assert [c.name for c in jar] == ["pfl_dashboard_session"]
        with _get(f"{base}api/snapshot", opener) as again:
            assert json.load(again)["source"] == "test"
        with _get(f"{base}static/dashboard.js") as script:  # static files are public code
            assert b"EventSource" in script.read()


def test_the_dashboard_serves_tls_with_the_provisioned_certificate(tmp_path: Path) -> None:
    made = provision(["dev-0000"], tmp_path / "fleet", host="127.0.0.1")
    tls = made.directory / "tls"
    settings = DashboardSettings(
        listen="127.0.0.1:0", cert_file=tls / "server.crt", key_file=tls / "server.key"
    )
    board = Board("tls")
    with DashboardServer(
        board, LOOPBACK, cert_file=settings.cert_file, key_file=settings.key_file
    ) as server:
        assert server.url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        snapshot = f"{_base(server)}api/snapshot"
        with _get(snapshot, headers=_bearer(server), context=context) as response:
            assert json.load(response)["source"] == "tls"
        with pytest.raises(urllib.error.URLError):  # a client that does not trust the CA
            _get(snapshot, headers=_bearer(server), context=ssl.create_default_context())


def test_bad_dashboard_settings_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both --dashboard-cert and --dashboard-key"):
        DashboardServer(Board("x"), LOOPBACK, cert_file=tmp_path / "a.crt")
    (tmp_path / "a-file").write_text("not a run")
    a_file = run_directory_dashboard(DashboardSettings(listen="127.0.0.1:0"), tmp_path / "a-file")
    with pytest.raises(ValueError, match="is a file, not a run directory"), a_file:
        pass
    with DashboardServer(Board("x"), LOOPBACK) as taken:
        busy = DashboardSettings(listen=f"127.0.0.1:{taken.port}")
        second = run_directory_dashboard(busy, tmp_path)
        with pytest.raises(ValueError, match="another program using that port"), second:
            pass
