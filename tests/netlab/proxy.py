"""A TCP fault proxy in front of a broker: latency, jitter, bandwidth, stalls, resets, partitions.

The kernel here has no `netem` qdisc, so what a bad link does to a TCP stream is played at the
stream level, per direction of each proxied connection: every piece read waits for its turn on
the link (a token bucket of `bandwidth_bps`), then for the one-way latency plus jitter (order is
kept, as TCP keeps it), and now and then for a stall (`stall_probability` per piece, what a lost
packet costs TCP: a retransmission timeout). Faults are commanded at run time from the test's
thread: `reset()` cuts every connection, `cut_after()` cuts once a direction has carried a given
number of bytes (mid-chunk, deterministically), `partition()` drops connections and refuses or
black-holes new ones until `heal()`. Byte counters say what really crossed.

Everything runs on one asyncio loop in a daemon thread; it listens on loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from tests.netlab.profiles import Link

HOST: Final = "127.0.0.1"
_PIECE_BYTES: Final = 16 * 1024
_QUEUED_PIECES: Final = 64
T = TypeVar("T")
Direction = Literal["up", "down"]
"""up: client -> broker; down: broker -> client."""
PartitionMode = Literal["reset", "blackhole"]


@dataclass
class _Cut:
    direction: Direction
    at_bytes: int


@dataclass
class _Pipe:
    """One direction of one connection: a reader pacing the link, a writer keeping latency."""

    direction: Direction
    writer: asyncio.StreamWriter
    queue: asyncio.Queue[tuple[float, bytes] | None] = field(
        default_factory=lambda: asyncio.Queue(_QUEUED_PIECES)
    )
    link_free_at: float = 0.0
    last_delivery: float = 0.0


@dataclass
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    closed: bool = False


class FaultProxy:
    """Forwards 127.0.0.1:`port` to the upstream address through a simulated `Link`.

    Use as a context manager, or `start()`/`stop()`. Control methods may be called from any
    thread; they return once the loop applied them.
    """

    def __init__(
        self,
        upstream_port: int,
        link: Link | None = None,
        *,
        upstream_host: str = HOST,
        seed: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.link = link or Link("loopback")
        self.port = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections_accepted = 0
        self.connections_refused = 0
        self.resets = 0
        self._random = random.Random(seed)
        self._connections: list[_Connection] = []
        self._partition: PartitionMode | None = None
        self._held_until = 0.0
        self._cut: _Cut | None = None
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fault-proxy", daemon=True
        )

    @property
    def url(self) -> str:
        """The broker URL a client should use to go through this proxy."""
        return f"mqtt://{HOST}:{self.port}"

    def start(self) -> FaultProxy:
        """Listen on a free loopback port."""
        self._thread.start()
        self._server = self._call(self._listen())
        return self

    def stop(self) -> None:
        """Close every connection and the listener, then end the loop's thread."""
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def set_link(self, link: Link) -> None:
        """Shape connections from now on (open ones too) as `link`."""
        self._call(self._apply(lambda: setattr(self, "link", link)))

    def reset(self) -> int:
        """Cut every open connection (both sides see it closed); return how many were cut."""
        return self._call(self._reset_all())

    def cut_after(self, direction: Direction, more_bytes: int) -> None:
        """Cut every connection once `direction` has carried `more_bytes` more bytes (once)."""
        total = self.bytes_up if direction == "up" else self.bytes_down

        def arm() -> None:
            self._cut = _Cut(direction, total + more_bytes)

        self._call(self._apply(arm))

    @property
    def cut_pending(self) -> bool:
        """Whether a `cut_after` has not fired yet."""
        return self._cut is not None

    def stall(self, seconds: float) -> None:
        """Hold every byte in flight, both directions, for `seconds` (connections stay open)."""
        until = time.monotonic() + seconds

        def hold() -> None:
            self._held_until = max(self._held_until, until)

        self._call(self._apply(hold))

    def partition(self, mode: PartitionMode = "reset") -> None:
        """Start a partition: open connections are cut, new ones refused until `heal()`.

        "reset" closes new connections at once; "blackhole" accepts them and never answers,
        as a silent network does (the client finds out by its keep-alive).
        """
        self._call(self._start_partition(mode))

    def heal(self) -> None:
        """End the partition: new connections pass again (black-holed ones are cut now)."""
        self._call(self._heal())

    def wait_quiet(self, quiet_s: float, timeout_s: float) -> bool:
        """Wait until no byte crossed for `quiet_s`; False if that did not happen in `timeout_s`.

        What a transfer costs is only known once the broker stopped sending: the count right
        after the receiver completed misses a resend still on its way.
        """
        deadline = time.monotonic() + timeout_s
        last = (self.bytes_up, self.bytes_down)
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = (self.bytes_up, self.bytes_down)
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                return True
        return False

    @property
    def partitioned(self) -> bool:
        """Whether a partition is on."""
        return self._partition is not None

    @property
    def open_connections(self) -> int:
        """Connections being proxied now."""
        return sum(1 for c in self._connections if not c.closed)

    # -- the loop's side -----------------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _apply(self, change: Callable[[], object]) -> None:
        change()

    async def _listen(self) -> asyncio.Server:
        server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    async def _reset_all(self) -> int:
        cut = [c for c in self._connections if not c.closed]
        for connection in cut:
            self._close(connection)
        self.resets += len(cut)
        self._connections = [c for c in self._connections if not c.closed]
        return len(cut)

    async def _start_partition(self, mode: PartitionMode) -> None:
        self._partition = mode
        await self._reset_all()

    async def _heal(self) -> None:
        self._partition = None
        await self._reset_all()  # black-holed connections end; clients reconnect through

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partition == "reset":
            self.connections_refused += 1
            _abort(writer)
            return
        if self._partition == "blackhole":
            self.connections_refused += 1
            await self._swallow(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self.connections_refused += 1
            _abort(writer)
            return
        self.connections_accepted += 1
        connection = _Connection(writer, up_writer)
        self._connections.append(connection)
        up = _Pipe("up", up_writer)
        down = _Pipe("down", writer)
        connection.tasks = [
            asyncio.create_task(self._read(connection, reader, up)),
            asyncio.create_task(self._write(connection, up)),
            asyncio.create_task(self._read(connection, up_reader, down)),
            asyncio.create_task(self._write(connection, down)),
        ]

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A black hole: read and drop until the client gives up or the partition heals."""
        connection = _Connection(writer, writer)
        self._connections.append(connection)
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while not connection.closed and await reader.read(_PIECE_BYTES):
                pass
        self._close(connection)

    async def _read(
        self, connection: _Connection, reader: asyncio.StreamReader, pipe: _Pipe
    ) -> None:
        try:
            while not connection.closed:
                link = self.link
                rate = link.rate(pipe.direction)
                size = _PIECE_BYTES if rate is None else max(256, min(_PIECE_BYTES, rate // 20))
                data = await reader.read(size)
                if not data:
                    break
                now = time.monotonic()
                if rate is not None:  # the link is busy until this piece has been serialized
                    pipe.link_free_at = max(pipe.link_free_at, now) + len(data) / rate
                    await asyncio.sleep(max(0.0, pipe.link_free_at - time.monotonic()))
                    now = time.monotonic()
                delay = link.latency_s + self._random.uniform(0.0, link.jitter_s)
                if link.stall_probability and self._random.random() < link.stall_probability:
                    delay += link.stall_s
                pipe.last_delivery = max(pipe.last_delivery, now + delay)
                await pipe.queue.put((pipe.last_delivery, data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                pipe.queue.put_nowait(None)
            if pipe.queue.full():
                self._close(connection)

    async def _write(self, connection: _Connection, pipe: _Pipe) -> None:
        try:
            while not connection.closed:
                item = await pipe.queue.get()
                if item is None:
                    break
                deliver_at, data = item
                while True:
                    wait = max(deliver_at, self._held_until) - time.monotonic()
                    if wait <= 0:
                        break
                    await asyncio.sleep(wait)
                if connection.closed:
                    return
                data, cut = self._cut_if_due(pipe.direction, data)
                self._count(pipe.direction, len(data))  # before the peer can see them
                pipe.writer.write(data)
                await pipe.writer.drain()
                if cut:
                    await self._reset_all()
                    return
        except OSError:
            pass
        self._close(connection)

    def _cut_if_due(self, direction: Direction, data: bytes) -> tuple[bytes, bool]:
        """`data`, or the part of it before an armed cut (and True: cut now)."""
        cut = self._cut
        if cut is None or cut.direction != direction:
            return data, False
        carried = self.bytes_up if direction == "up" else self.bytes_down
        room = cut.at_bytes - carried
        if room >= len(data):
            return data, False
        self._cut = None
        return data[: max(0, room)], True

    def _count(self, direction: Direction, size: int) -> None:
        if direction == "up":
            self.bytes_up += size
        else:
            self.bytes_down += size

    def _close(self, connection: _Connection) -> None:
        if connection.closed:
            return
        connection.closed = True
        _abort(connection.client)
        _abort(connection.upstream)
        for task in connection.tasks:
            if task is not asyncio.current_task():
                task.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close at once, unsent bytes dropped: what a reset link does to both ends."""
    transport = writer.transport
    with contextlib.suppress(OSError, RuntimeError):
        transport.abort()
