"""The broker and the listener of the arm64 check: what each device said, and when.

A round's time on a device is measured on the host's clock, from the round's announcement to the
device's answer (its update, or its evaluation report), so the emulated agent and the host agent
are timed alike without trusting either's clock or logs.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from protocols import topics
from protocols.codec import decode_frame
from protocols.errors import PflError
from protocols.messages import DeviceHello, DeviceUpdate, EvaluationReport, RoundAnnouncement
from protocols.transport.broker import free_port
from protocols.transport.factory import connect

HOST = "127.0.0.1"
FLEET = "default"


@dataclasses.dataclass(frozen=True)
class RoundTime:
    """One device's answer to one announced phase of one round, timed on the host."""

    round_id: int
    phase: str
    algorithm: str
    device_id: str
    seconds: float


@dataclasses.dataclass
class Events:
    """What the recorder heard: the hellos (with their arrival time) and the round times."""

    hellos: dict[str, tuple[float, DeviceHello]] = dataclasses.field(default_factory=dict)
    rounds: list[RoundTime] = dataclasses.field(default_factory=list)
    started: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class FleetRun:
    """A finished run: the recorder's events, serve's wall time and its run directory."""

    events: Events
    serve_seconds: float
    run_dir: Path


def start_mosquitto(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Debian's mosquitto on a free loopback port (anonymous, no persistence); its URL."""
    port = free_port(HOST)
    config = directory / "mosquitto.conf"
    config.write_text(
        f"listener {port} {HOST}\nallow_anonymous true\npersistence false\nuser root\n"
        "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"
    )
    with (directory / "mosquitto.log").open("wb") as log:
        process = subprocess.Popen(
            ["/usr/sbin/mosquitto", "-c", str(config)], stdout=subprocess.DEVNULL, stderr=log
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return process, f"mqtt://{HOST}:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    msg = f"mosquitto did not listen on {HOST}:{port}"
    raise RuntimeError(msg)


class Recorder:
    """An operator client on the announcements and on every device's hello, update, evaluation."""

    def __init__(self, url: str) -> None:
        self.events = Events()
        self._announced: dict[tuple[int, str], tuple[float, str]] = {}
        self._lock = threading.Lock()
        client_id = f"{topics.RESERVED_PREFIX}arm64-check-{uuid.uuid4().hex[:8]}"
        self._transport = connect(url, client_id, clean_start=True)
        self._transport.subscribe(topics.round_announcement(FLEET), self._on_message)
        for kind in ("hello", "update", "evaluation"):
            self._transport.subscribe(topics.device_subscription(FLEET, kind), self._on_message)

    def _on_message(self, topic: str, payload: bytes) -> None:
        now = time.monotonic()
        try:
            message, _ = decode_frame(payload)
        except PflError:
            return
        with self._lock:
            if isinstance(message, RoundAnnouncement):
                key = (message.round_id, message.phase)
                self._announced.setdefault(key, (now, message.algorithm))
            elif isinstance(message, DeviceHello):
                self.events.hellos[message.device_id] = (now - self.events.started, message)
            elif isinstance(message, DeviceUpdate | EvaluationReport):
                phase = "train" if isinstance(message, DeviceUpdate) else "evaluate"
                announced = self._announced.get((message.round_id, phase))
                if announced is not None:
                    time_s = now - announced[0]
                    self.events.rounds.append(
                        RoundTime(message.round_id, phase, announced[1], message.device_id, time_s)
                    )

    def stop(self) -> Events:
        """Disconnect and hand over what was heard."""
        self._transport.close()
        with self._lock:
            return self.events


@dataclasses.dataclass(frozen=True)
class ExportCheck:
    """`pfl-agent export --json`'s report on arm64, its time, the probe's output on each side."""

    report: dict[str, Any]
    seconds: float
    arm: dict[str, Any]
    host: dict[str, Any]
