"""Shared fixtures: real brokers on free loopback ports (mosquitto subprocess, embedded amqtt)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from protocols.transport.broker import EmbeddedBroker
from protocols.transport.broker import free_port as _free_port

# The suite's models are tiny and agent processes run beside it: one intra-op thread avoids
# OpenMP threads spinning against each other on a 2-core machine (tens of times slower).
torch.set_num_threads(1)

HOST = "127.0.0.1"
MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto",)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return _free_port(HOST)


def wait_for_port(port: int, timeout_s: float = 10.0) -> bool:
    """Poll until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def installed_binary(name: str, candidates: tuple[str, ...], why: str) -> str:
    """A Debian package's executable; fails the test (never skips) when it is missing."""
    for candidate in candidates:
        if Path(candidate).is_file():
            return candidate
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed; {why}: run `sudo apt-get install -y {name}` "
            "(Debian/Ubuntu) and try again",
            pytrace=False,
        )
    return found


def mosquitto_binary() -> str:
    """The mosquitto executable."""
    return installed_binary("mosquitto", MOSQUITTO_CANDIDATES, "these tests need a real broker")


class Mosquitto:
    """A mosquitto process on a fixed loopback port, restartable on the same port."""

    def __init__(self, binary: str, directory: Path, port: int, extra_config: str = "") -> None:
        self.binary = binary
        self.port = port
        self.url = f"mqtt://{HOST}:{port}"
        self.config = directory / f"mosquitto-{port}.conf"
        self.log = directory / f"mosquitto-{port}.log"
        # As root, mosquitto would drop to its own user, who cannot read pytest's 0700 tmp dirs.
        run_as = "user root\n" if os.geteuid() == 0 else ""
        self.config.write_text(
            f"listener {port} {HOST}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            f"{run_as}"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
            f"{extra_config}"
        )
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start mosquitto and wait until it accepts connections."""
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                [self.binary, "-c", str(self.config)], stdout=subprocess.DEVNULL, stderr=log
            )
        if not wait_for_port(self.port):
            self.stop()
            written = self.log.read_text() if self.log.exists() else ""
            pytest.fail(f"mosquitto did not listen on {self.url}; its log:\n{written}")

    def stop(self) -> None:
        """Terminate mosquitto (its clients see the connection drop)."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)
        self._process = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop and start again on the same port, with no state (persistence is off)."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def log_text(self) -> str:
        """What mosquitto logged so far."""
        return self.log.read_text() if self.log.exists() else ""


def _start_mosquitto(tmp_path: Path, extra_config: str = "") -> Mosquitto:
    broker = Mosquitto(mosquitto_binary(), tmp_path, free_port(), extra_config)
    broker.start()
    return broker


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = _start_mosquitto(tmp_path)
    yield broker
    broker.stop()


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[Callable[[str], Mosquitto]]:
    """Start extra mosquitto instances with additional config lines (size limits, ...)."""
    started: list[Mosquitto] = []

    def start(extra_config: str = "") -> Mosquitto:
        broker = _start_mosquitto(tmp_path, extra_config)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


def make_certificates(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the TLS test needs the openssl CLI: `sudo apt-get install -y openssl`")
    directory.mkdir()
    files = {name: directory / name for name in ("ca.crt", "ca.key", "server.crt", "server.key")}
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    commands = [
        f"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=pfl-test-ca "
        f"-keyout {files['ca.key']} -out {files['ca.crt']}",
        f"req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 "
        f"-keyout {files['server.key']} -out {directory / 'server.csr'}",
        f"x509 -req -days 1 -in {directory / 'server.csr'} -CA {files['ca.crt']} "
        f"-CAkey {files['ca.key']} -CAcreateserial -extfile {directory / 'san.cnf'} "
        f"-out {files['server.crt']}",
    ]
    for command in commands:
        subprocess.run([openssl, *command.split()], check=True, capture_output=True)
    return files


@pytest.fixture
def mosquitto_tls(tmp_path: Path) -> Iterator[tuple[Mosquitto, Path]]:
    """Mosquitto with a TLS listener; yields it and the CA file clients must trust."""
    certificates = make_certificates(tmp_path / "tls")
    broker = _start_mosquitto(
        tmp_path,
        f"cafile {certificates['ca.crt']}\ncertfile {certificates['server.crt']}\n"
        f"keyfile {certificates['server.key']}\n",
    )
    yield broker, certificates["ca.crt"]
    broker.stop()


@pytest.fixture
def embedded_broker() -> Iterator[EmbeddedBroker]:
    broker = EmbeddedBroker(HOST, free_port(), run_access=None)  # open: transport tests
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(params=[pytest.param("mosquitto", marks=pytest.mark.mosquitto), "embedded"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The URL of each kind of broker in turn."""
    fixture = "mosquitto" if request.param == "mosquitto" else "embedded_broker"
    return str(request.getfixturevalue(fixture).url)
