"""The dashboard's HTTP side against a hostile neighbour: idle floods, slow heads, foreign Hosts.

Everything listens on 127.0.0.1 and opens a bounded number of sockets.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from coordinator.dashboard.board import Board
from coordinator.dashboard.connections import ConnectionLimits
from coordinator.dashboard.gate import HostCheck
from coordinator.dashboard.launch import run_directory_dashboard
from coordinator.dashboard.server import DashboardServer, Listen
from coordinator.dashboard.settings import DashboardSettings
from coordinator.run.settings import ServeSettings

LOOPBACK = Listen("127.0.0.1", 0)
REPO = Path(__file__).resolve().parents[2]
FILE_LIMIT = 160
"""RLIMIT_NOFILE of the flooded dashboard's process: far fewer than the idle sockets."""
IDLE_SOCKETS = 400

FLOODED_DASHBOARD = textwrap.dedent(
    f"""
    import resource, sys, tempfile
    resource.setrlimit(resource.RLIMIT_NOFILE, ({FILE_LIMIT}, {FILE_LIMIT}))
    from coordinator.dashboard.board import Board
    from coordinator.dashboard.server import DashboardServer, Listen
    server = DashboardServer(Board("flooded"), Listen("127.0.0.1", 0)).start()
    print(server.port, server.token or "", flush=True)
    for _ in sys.stdin:  # what serve does beside the dashboard: write its files
        try:
            with tempfile.TemporaryFile() as handle:
                handle.write(b"checkpoint")
            print("written", flush=True)
        except OSError as error:
            print(f"cannot write: {{error}}", flush=True)
    """
)


def _request(
    port: int, path: str, *, token: str | None = None, host: str | None = None
) -> tuple[int, bytes]:
    """GET `path` with the token as a bearer header and the given Host header; (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.putrequest("GET", path, skip_host=True)
        connection.putheader("Host", host or f"127.0.0.1:{port}")
        if token:
            connection.putheader("Authorization", f"Bearer {token}")
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@contextmanager
def _idle_sockets(port: int, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections that never send a byte (those the server refuses are left closed)."""
    with ExitStack() as stack:
        opened = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.settimeout(2.0)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError:
                continue
            opened.append(sock)
        yield opened


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (read end of file) rather than keeping it open."""
    sock.settimeout(15.0)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_cannot_use_up_the_processs_files(tmp_path: Path) -> None:
    # Prepare: a dashboard in a process allowed FILE_LIMIT files
    process = subprocess.Popen(
        [sys.executable, "-c", FLOODED_DASHBOARD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        port_text, token = process.stdout.readline().split(" ")
        port, token = int(port_text), token.strip()
        # Execute: more idle connections than the process may hold files, all held open
        with _idle_sockets(port, IDLE_SOCKETS) as idle:
            status, body = _request(port, "/api/snapshot", token=token)
            process.stdin.write("write\n")
            process.stdin.flush()
            written = process.stdout.readline().strip()
            alive = process.poll() is None
        # Assert: it still answers, can still write a file, and lives
        assert len(idle) > FILE_LIMIT
        assert status == 200
        assert json.loads(body)["source"] == "flooded"
        assert written == "written"
        assert alive
    finally:
        process.kill()
        process.wait(10)


def test_a_full_house_of_idle_connections_makes_room_for_a_request() -> None:
    limits = ConnectionLimits(max_connections=4)
    server = DashboardServer(Board("x"), LOOPBACK, token="t0ken", limits=limits)
    with server, _idle_sockets(server.port, 10) as idle:
        status, _ = _request(server.port, "/api/snapshot", token="t0ken")
        assert status == 200
        assert _closed_by_server(idle[0])  # the longest-open idle one made room


def test_a_request_head_too_slow_or_never_sent_is_closed() -> None:
    limits = ConnectionLimits(header_timeout_s=0.3)
    with DashboardServer(Board("x"), LOOPBACK, token="t0ken", limits=limits) as server:
        with _idle_sockets(server.port, 2) as (silent, slow):
            slow.sendall(b"GET /api/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
            assert _closed_by_server(silent)
            assert _closed_by_server(slow)
        status, _ = _request(server.port, "/api/snapshot", token="t0ken")
        assert status == 200


def test_the_dashboard_answers_only_to_its_own_host_names() -> None:
    with DashboardServer(Board("x"), LOOPBACK, token="t0ken") as server:
        port = server.port
        for host in ("evil.example", f"evil.example:{port}", f"rebind.127.0.0.1.nip.io:{port}"):
            assert _request(port, "/api/snapshot", token="t0ken", host=host)[0] == 400
            assert _request(port, "/static/dashboard.js", host=host)[0] == 400
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert _request(port, "/api/snapshot", token="t0ken", host=host)[0] == 200


@pytest.mark.parametrize(
    ("listen", "header", "allowed"),
    [
        ("127.0.0.1", "127.0.0.1:8080", True),
        ("127.0.0.1", "LOCALHOST.:8080", True),
        ("127.0.0.1", "10.0.0.5:8080", False),
        ("0.0.0.0", "10.0.0.5:8080", True),
        ("0.0.0.0", "coordinator.example:8080", False),
        ("::", "[fe80::1]:8080", True),
        ("coordinator.local", "coordinator.local:8080", True),
        ("coordinator.local", "attacker.example", False),
        ("127.0.0.1", "", False),
        ("127.0.0.1", "localhost:http", False),
    ],
)
def test_host_headers_are_checked_against_the_listen_address(
    listen: str, header: str, allowed: bool
) -> None:
    assert HostCheck(listen).allows(header) is allowed


def test_a_token_is_required_on_loopback_unless_the_operator_opts_out(tmp_path: Path) -> None:
    with DashboardServer(Board("x"), LOOPBACK) as server:
        assert server.token
        assert _request(server.port, "/api/snapshot")[0] == 401
        assert _request(server.port, "/api/snapshot", token=server.token)[0] == 200
    with DashboardServer(Board("x"), LOOPBACK, open_to_local_users=True) as server:
        assert server.token is None
        assert _request(server.port, "/api/snapshot")[0] == 200
    with pytest.raises(ValueError, match="loopback"):
        DashboardServer(Board("x"), Listen("0.0.0.0", 0), open_to_local_users=True)
    with pytest.raises(ValueError, match="no token"):
        DashboardServer(Board("x"), LOOPBACK, token="t0ken", open_to_local_users=True)


def test_the_made_up_token_is_written_to_a_file_only_its_owner_reads(tmp_path: Path) -> None:
    token_file = tmp_path / "dashboard-token"
    settings = DashboardSettings(listen="127.0.0.1:0", token_file=token_file)
    with run_directory_dashboard(settings, tmp_path) as server:
        assert token_file.read_text().strip() == server.token
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert (
            _request(server.port, "/api/snapshot", token=token_file.read_text().strip())[0] == 200
        )


def test_serve_passes_the_token_file_and_the_opt_out_to_its_dashboard(tmp_path: Path) -> None:
    settings = ServeSettings.load(
        None,
        dashboard="127.0.0.1:0",
        dashboard_token_file=tmp_path / "token",
        dashboard_open_to_local_users=True,
    )
    board = settings.dashboard_settings()
    assert board is not None
    assert (board.token_file, board.open_to_local_users) == (tmp_path / "token", True)
