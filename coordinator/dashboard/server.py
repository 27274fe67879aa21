"""The dashboard's web server: the page, its data as JSON, and a stream of changes (SSE).

Starlette on uvicorn (pure Python, no build step): the page and its charting library ship with
the package, so a coordinator with no internet shows it. Read-only: nothing here changes a run.
Bound to loopback by default. It asks for a token (made up per run unless given), on loopback
too unless the operator opts out, and serves TLS when given a certificate: the fleet table names
every device. Requests must name its own host (`gate`); connections are limited (`connections`).
"""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from coordinator.dashboard.board import Board
from coordinator.dashboard.connections import ConnectionLimits, limited_protocol
from coordinator.dashboard.gate import DashboardGate, HostCheck
from coordinator.dashboard.headers import SecurityHeaders
from coordinator.dashboard.runs import RunLibrary
from coordinator.dashboard.stream import EventEncoder, accepts_gzip, snapshot_delta

logger = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
PUSH_INTERVAL_S = 0.5
"""At most two snapshots a second per viewer, however fast the fleet changes."""
KEEPALIVE_S = 15.0
FINAL_PUSH_S = 3.0
"""How long stopping waits for open pages to get the last change (e.g. the run's "finished")."""


class OpenStreams:
    """The version each open event stream sent last, so that stopping can wait for the last one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[int, int] = {}

    def sent(self, stream: int, version: int) -> None:
        """Stream `stream` sent `version`."""
        with self._lock:
            self._sent[stream] = version

    def closed(self, stream: int) -> None:
        """Stream `stream` ended."""
        with self._lock:
            self._sent.pop(stream, None)

    def behind(self, version: int) -> bool:
        """Whether an open stream has not sent `version` yet."""
        with self._lock:
            return any(sent < version for sent in self._sent.values())


@dataclass(frozen=True)
class Listen:
    """Where the dashboard listens: `host:port` (port 0 picks a free one)."""

    host: str = "127.0.0.1"
    port: int = 8080

    @classmethod
    def parse(cls, text: str) -> Listen:
        """`HOST:PORT`, `:PORT` (loopback) or `PORT`; IPv6 hosts in brackets.

        Raises:
            ValueError: not an address with a port in 0..65535.
        """
        host, _, port = text.rpartition(":") if ":" in text else ("", "", text)
        host = host.strip("[]") or "127.0.0.1"
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            msg = f"--dashboard wants HOST:PORT (e.g. 127.0.0.1:8080), not {text!r}"
            raise ValueError(msg)
        return cls(host, int(port))

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach it."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: assume the network


def dashboard_app(
    board: Board,
    token: str | None,
    hosts: HostCheck,
    stopping: threading.Event,
    runs: RunLibrary | None = None,
    streams: OpenStreams | None = None,
) -> Starlette:
    """The ASGI app: `/` the page, `/api/snapshot` the data, `/api/events` its changes.

    `/api/runs` lists the runs the page may overlay (`runs`' siblings; none without it),
    `/api/runs/NAME` one's rounds.

    Every request passes the gate: its own host names only, and the token when there is one.
    """

    async def page(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def snapshot(request: Request) -> Response:
        body = board.snapshot_json().encode()
        headers = {"Cache-Control": "no-store", "Vary": "Accept-Encoding"}
        if accepts_gzip(request.headers.get("accept-encoding", "")):
            body = gzip.compress(body, compresslevel=6, mtime=0)
            headers["Content-Encoding"] = "gzip"
        return Response(body, media_type="application/json", headers=headers)

    async def events(request: Request) -> Response:
        encoder = EventEncoder(accepts_gzip(request.headers.get("accept-encoding", "")))
        headers = {
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
            "Vary": "Accept-Encoding",
        }
        if encoder.gzip:
            headers["Content-Encoding"] = "gzip"
        return StreamingResponse(
            _event_stream(board, request, stopping, encoder, streams or OpenStreams()),
            media_type="text/event-stream",
            headers=headers,
        )

    async def run_list(_: Request) -> Response:
        return JSONResponse({"runs": runs.names() if runs else []})

    async def run_rounds(request: Request) -> Response:
        found = runs.rounds(request.path_params["name"]) if runs else None
        if found is None:
            return PlainTextResponse("no such run beside this one", status_code=404)
        return JSONResponse({"rounds": found})

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def icon(_: Request) -> Response:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/api/snapshot", snapshot),
            Route("/api/events", events),
            Route("/api/runs", run_list),
            Route("/api/runs/{name}", run_rounds),
            Route("/healthz", health),
            Route("/favicon.ico", icon),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
    app.add_middleware(DashboardGate, token=token, hosts=hosts)
    app.add_middleware(SecurityHeaders)
    return app


async def _event_stream(
    board: Board,
    request: Request,
    stopping: threading.Event,
    encoder: EventEncoder,
    streams: OpenStreams,
) -> AsyncIterator[bytes]:
    """The snapshot now, then what changed after every change (at most every PUSH_INTERVAL_S).

    Between changes, keep-alives. See `stream` for the delta's form.
    """
    sent: dict[str, Any] | None = None
    quiet_since = time.monotonic()
    streams.sent(id(encoder), -1)
    try:
        while not stopping.is_set() and not await request.is_disconnected():
            version, state = board.state() if board.version != _version(sent) else (-1, {})
            if sent is None:
                yield encoder.event("snapshot", state, time.time())
            elif version >= 0:
                yield encoder.event("delta", snapshot_delta(sent, state), time.time())
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield encoder.raw(": still here\n\n")
            if version >= 0:
                sent, quiet_since = state, time.monotonic()
                streams.sent(id(encoder), version)
            await asyncio.sleep(PUSH_INTERVAL_S)
    finally:
        streams.closed(id(encoder))


def _version(sent: dict[str, Any] | None) -> int:
    return -1 if sent is None else int(sent["version"])


class DashboardServer:
    """The dashboard on a thread of its own, for `serve --dashboard` and `pfl-coord dashboard`."""

    def __init__(
        self,
        board: Board,
        listen: Listen,
        *,
        token: str | None = None,
        open_to_local_users: bool = False,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        limits: ConnectionLimits | None = None,
        runs: RunLibrary | None = None,
    ) -> None:
        """A token is required, made up when none is given; on loopback the operator may opt out.

        Raises:
            ValueError: a certificate without its key, or the other way round; no token asked
                for off loopback, or together with a token.
        """
        if (cert_file is None) != (key_file is None):
            msg = "the dashboard's TLS needs both --dashboard-cert and --dashboard-key"
            raise ValueError(msg)
        if open_to_local_users and (token is not None or not listen.loopback):
            msg = (
                "a dashboard open to local users listens on loopback and has no token: "
                "drop the token or the address beyond loopback"
            )
            raise ValueError(msg)
        self.token = None if open_to_local_users else token or secrets.token_urlsafe(18)
        self.listen = listen
        self.tls = cert_file is not None
        self._stopping = threading.Event()
        self._board = board
        self._streams = OpenStreams()
        limits = limits or ConnectionLimits()
        config = uvicorn.Config(
            dashboard_app(
                board, self.token, HostCheck(listen.host), self._stopping, runs, self._streams
            ),
            host=listen.host,
            port=listen.port,
            log_level="warning",
            ssl_certfile=cert_file,
            ssl_keyfile=key_file,
            timeout_graceful_shutdown=2,
            lifespan="off",
            http=limited_protocol(limits),
            limit_concurrency=2 * limits.max_connections,
            backlog=limits.backlog,
            timeout_keep_alive=limits.keep_alive_s,
            h11_max_incomplete_event_size=limits.max_header_bytes,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="dashboard", daemon=True)

    def _run(self) -> None:
        try:
            self._server.run()
        except SystemExit:  # uvicorn's way of saying it could not bind: start() reports it
            logger.debug("the dashboard's server exited at startup")

    def start(self, timeout_s: float = 10.0) -> DashboardServer:
        """Listen, and return once the socket is bound.

        Raises:
            OSError: the address is taken or cannot be bound.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and time.monotonic() < deadline:
            if not self._thread.is_alive():
                msg = f"the dashboard cannot listen on {self.listen.host}:{self.listen.port}"
                raise OSError(msg)
            time.sleep(0.02)
        if not self._server.started:
            msg = f"the dashboard did not start listening within {timeout_s:.0f} s"
            raise OSError(msg)
        if self.token is None:
            logger.warning(
                "the dashboard has no token: every user of this machine can read every "
                "device's results on %s",
                self.url,
            )
        if not self.listen.loopback and not self.tls:
            logger.warning(
                "the dashboard listens on %s without TLS: its token crosses the network in "
                "the clear (give --dashboard-cert and --dashboard-key)",
                self.listen.host,
            )
        return self

    @property
    def port(self) -> int:
        """The port it listens on (the one picked when asked for 0)."""
        for server in self._server.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.listen.port

    @property
    def url(self) -> str:
        """The address to open, with the token when there is one."""
        host = f"[{self.listen.host}]" if ":" in self.listen.host else self.listen.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
        base = f"{'https' if self.tls else 'http'}://{host}:{self.port}/"
        return base if self.token is None else f"{base}?token={self.token}"

    def stop(self) -> None:
        """Let open pages get the last change (FINAL_PUSH_S at most), then close and stop."""
        deadline = time.monotonic() + FINAL_PUSH_S
        while self._streams.behind(self._board.version) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stopping.set()
        self._server.should_exit = True
        self._thread.join(10.0)

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
