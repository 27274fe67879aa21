"""Starting a dashboard (inside `serve`, on a broker, on a run directory) and stopping it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.dashboard.board import Board
from coordinator.dashboard.feeds import RunDirectoryFeed, watch_broker
from coordinator.dashboard.runs import RunLibrary
from coordinator.dashboard.server import DashboardServer, Listen
from coordinator.dashboard.settings import DashboardSettings
from protocols.atomic import write_atomically
from protocols.errors import StateError
from protocols.transport.settings import BrokerSettings


@contextmanager
def broker_dashboard(
    settings: DashboardSettings,
    broker: BrokerSettings,
    fleet: str,
    say: Callable[[str], None] = lambda _: None,
) -> Iterator[DashboardServer]:
    """A dashboard following `fleet` on `broker` while the block runs.

    Raises:
        ValueError: bad dashboard settings, or the address cannot be bound.
        BrokerConnectionError: the broker cannot be reached.
    """
    board = Board(f"{broker.url} · fleet {fleet}", fleet)
    with _started(_server(settings, board), settings.token_file) as server:
        transport = watch_broker(board, broker, fleet)
        try:
            say(f"dashboard on {server.url}")
            yield server
        finally:
            transport.close()


@contextmanager
def engine_dashboard(
    settings: DashboardSettings, source: str, fleet: str, say: Callable[[str], None]
) -> Iterator[Board]:
    """A dashboard inside `serve`, fed by its engine through `feeds.ViewTap` (no MQTT session).

    Raises:
        ValueError: bad dashboard settings, or the address cannot be bound.
    """
    board = Board(f"{source} · fleet {fleet}", fleet)
    with _started(_server(settings, board), settings.token_file) as server:
        say(f"dashboard on {server.url}")
        yield board


@contextmanager
def run_directory_dashboard(
    settings: DashboardSettings, directory: Path, say: Callable[[str], None] = lambda _: None
) -> Iterator[DashboardServer]:
    """A dashboard following a run directory (finished, still being written, or not made yet).

    A directory that does not exist yet is waited for: the page says so until the run makes it.

    Raises:
        ValueError: bad dashboard settings, the address cannot be bound, or `directory` is a file.
    """
    if directory.exists() and not directory.is_dir():
        msg = f"{directory} is a file, not a run directory (give the --out of a run)"
        raise ValueError(msg)
    if not directory.is_dir():
        say(f"waiting for {directory} to appear (the --out of a simulate or serve run)")
    board = Board(str(directory))
    feed = RunDirectoryFeed(board, directory).start()
    try:
        server = _server(settings, board, RunLibrary(directory))
        with _started(server, settings.token_file) as server:
            say(f"dashboard on {server.url}")
            yield server
    finally:
        feed.stop()


def _server(
    settings: DashboardSettings, board: Board, runs: RunLibrary | None = None
) -> DashboardServer:
    return DashboardServer(
        board,
        Listen.parse(settings.listen),
        token=settings.token,
        open_to_local_users=settings.open_to_local_users,
        cert_file=settings.cert_file,
        key_file=settings.key_file,
        runs=runs,
    )


@contextmanager
def _started(server: DashboardServer, token_file: Path | None) -> Iterator[DashboardServer]:
    """The server listening, its token in `token_file` (mode 0600) when asked.

    Raises:
        ValueError: the address cannot be bound, or the token file cannot be written.
    """
    try:
        server.start()
    except OSError as error:
        msg = f"{error} (is another program using that port?)"
        raise ValueError(msg) from error
    try:
        if token_file is not None and server.token is not None:
            try:  # a fresh temporary file is 0600 from the start, then renamed into place
                write_atomically(token_file, f"{server.token}\n".encode())
            except StateError as error:
                raise ValueError(str(error)) from error
        yield server
    finally:
        server.stop()
