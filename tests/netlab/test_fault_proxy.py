"""The fault proxy itself: bytes intact, delay and bandwidth added, resets, cuts, partitions."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.netlab.profiles import PROFILES, Link, profile
from tests.netlab.proxy import HOST, FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with self.request as connection:
            while data := connection.recv(65536):
                connection.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer((HOST, 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _connect(proxy: FaultProxy) -> socket.socket:
    connection = socket.create_connection((HOST, proxy.port), timeout=30)
    connection.settimeout(30)
    return connection


def _exchange(connection: socket.socket, payload: bytes) -> bytes:
    """Send `payload` while reading the echo; return what came back."""
    sender = threading.Thread(target=connection.sendall, args=(payload,))
    sender.start()
    received = bytearray()
    while len(received) < len(payload):
        data = connection.recv(65536)
        if not data:
            break
        received += data
    sender.join()
    return bytes(received)


def _closed(connection: socket.socket) -> bool:
    """Whether the peer closed or reset the connection (waits for it, up to the timeout)."""
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True


def test_bytes_pass_intact_and_are_counted(echo_port: int) -> None:
    payload = os.urandom(1_000_000)
    with FaultProxy(echo_port, Link("jittery", latency_s=0.001, jitter_s=0.002)) as proxy:
        with _connect(proxy) as connection:
            assert _exchange(connection, payload) == payload
        assert proxy.bytes_up == len(payload)
        assert proxy.bytes_down == len(payload)
        assert proxy.connections_accepted == 1


def test_latency_delays_each_direction(echo_port: int) -> None:
    with FaultProxy(echo_port, Link("slow", latency_s=0.25)) as proxy, _connect(proxy) as conn:
        started = time.monotonic()
        assert _exchange(conn, b"ping") == b"ping"
        assert time.monotonic() - started >= 0.5  # one latency each way


def test_bandwidth_caps_throughput(echo_port: int) -> None:
    link = Link("thin", up_bps=100_000)  # 100 kB/s up, unlimited down
    payload = os.urandom(150_000)
    with FaultProxy(echo_port, link) as proxy, _connect(proxy) as connection:
        started = time.monotonic()
        assert _exchange(connection, payload) == payload
        assert time.monotonic() - started >= 1.4  # 150 kB at 100 kB/s, less the first piece


def test_stall_holds_bytes_then_delivers_them(echo_port: int) -> None:
    with FaultProxy(echo_port) as proxy, _connect(proxy) as connection:
        proxy.stall(0.5)
        started = time.monotonic()
        assert _exchange(connection, b"held") == b"held"
        assert time.monotonic() - started >= 0.4


def test_reset_cuts_open_connections(echo_port: int) -> None:
    with FaultProxy(echo_port) as proxy, _connect(proxy) as connection:
        assert _exchange(connection, b"up") == b"up"
        assert proxy.reset() == 1
        assert _closed(connection)
        with _connect(proxy) as again:  # the next connection passes
            assert _exchange(again, b"back") == b"back"


def test_cut_after_passes_exactly_the_bytes_before_the_cut(echo_port: int) -> None:
    payload = os.urandom(200_000)
    with FaultProxy(echo_port) as proxy, _connect(proxy) as connection:
        proxy.cut_after("down", 50_001)
        received = _exchange(connection, payload)
        assert received == payload[:50_001]
        assert not proxy.cut_pending
        assert proxy.bytes_down == 50_001


@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_partition_window_drops_then_heals(echo_port: int, mode: str) -> None:
    with FaultProxy(echo_port) as proxy:
        with _connect(proxy) as before:
            assert _exchange(before, b"up") == b"up"
            proxy.partition("reset" if mode == "reset" else "blackhole")
            assert _closed(before)
        with _connect(proxy) as during:
            if mode == "reset":
                assert _closed(during)
            else:  # accepted, but nothing comes back until the partition heals
                during.sendall(b"lost")
                during.settimeout(0.3)
                with pytest.raises(TimeoutError):
                    during.recv(1)
                proxy.heal()
                during.settimeout(30)
                assert _closed(during)
        proxy.heal()
        with _connect(proxy) as after:
            assert _exchange(after, b"healed") == b"healed"
        assert proxy.connections_refused == 1


def test_profiles_are_named_after_links() -> None:
    assert set(PROFILES) == {"loopback", "lte", "congested-wifi", "nb-iot-like"}
    nb_iot, lte = profile("nb-iot-like"), profile("lte")
    assert nb_iot.up_bps is not None
    assert lte.up_bps is not None
    assert nb_iot.up_bps < lte.up_bps
    assert nb_iot.latency_s > lte.latency_s
    with pytest.raises(KeyError, match="known: loopback"):
        profile("dial-up")
