"""Feeding a board: from `serve`'s own transport, a fleet's broker, or a run directory."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.dashboard.board import Board
from coordinator.dashboard.history import flatten_settings, round_summary
from coordinator.ops.status import watch_fleet
from coordinator.ops.view_intake import check_view_message, view_topic
from protocols.errors import PflError
from protocols.messages import (
    RUN_HISTORY_ROUNDS,
    CoordinatorStatus,
    DeviceResult,
    FleetStatus,
    RoundSummary,
    RunHistory,
)
from protocols.transport.base import MessageHandler, Transport, TransportWrapper
from protocols.transport.mqtt import MqttTransport
from protocols.transport.settings import BrokerSettings

logger = logging.getLogger(__name__)

RUN_FILES = ("run.json", "metrics.jsonl", "fleet.json", "devices.jsonl", "summary.json")
NO_RUN_ID = "0" * 32


def watch_broker(board: Board, broker: BrokerSettings, fleet: str) -> MqttTransport:
    """Subscribe `board` to the fleet's retained statuses and history; the caller closes it.

    Reads only what an operator account may (topics.operator_readable): never models or
    updates. Device statuses carry liveness: a vanished device's last-will marks it offline.

    Raises:
        BrokerConnectionError: the broker cannot be reached.
    """
    return watch_fleet(broker, fleet, board.offer, "dashboard", history=True)


class ViewTap(TransportWrapper):
    """`serve`'s own transport, also handing a board what passes on the fleet's view topics.

    The dashboard inside `serve` is fed this way, with no MQTT session of its own: the
    coordinator's status, fleet status and history as it publishes them, and the device statuses
    (last-wills included) as it receives them. The engine only files each payload under its
    topic (the latest wins, as with a retained message); a thread of the tap's own decodes them
    and offers them to the board, whose rule (`FleetView.offer`) decides what each topic may
    carry. Nothing the board does reaches the engine. Used as a context manager: leaving it hands
    the board what is still filed (the run's last status among it), then stops that thread (the
    inner transport stays open).
    """

    def __init__(self, inner: Transport, fleet: str, offer: Callable[[str, bytes], None]) -> None:
        super().__init__(inner)
        self._fleet = fleet
        self._offer = offer
        self._pending: dict[str, bytes] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._feed, name="dashboard-feed", daemon=True)

    def __enter__(self) -> ViewTap:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(10.0)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish, then file it for the board."""
        self.inner.publish(topic, payload, retain=retain)
        self._file(topic, payload)

    def publish_expiring(
        self, topic: str, payload: bytes, *, retain: bool = False, expiry_s: int
    ) -> None:
        """Publish with a message expiry, then file it for the board."""
        super().publish_expiring(topic, payload, retain=retain, expiry_s=expiry_s)
        self._file(topic, payload)

    def subscribe(self, pattern: str, handler: MessageHandler) -> None:
        """Subscribe: the engine's handler runs first, then the message is filed for the board."""

        def both(topic: str, payload: bytes) -> None:
            handler(topic, payload)
            self._file(topic, payload)

        self.inner.subscribe(pattern, both)

    def _file(self, topic: str, payload: bytes) -> None:
        if view_topic(self._fleet, topic) is None:
            return
        with self._wake:
            self._pending[topic] = payload
            self._wake.notify()

    def _feed(self) -> None:
        stopping = False
        while not stopping:
            with self._wake:
                while not self._pending and not self._stopped:
                    self._wake.wait()
                batch, self._pending = self._pending, {}
                stopping = self._stopped
            for topic, payload in batch.items():
                try:
                    self._offer(topic, payload)
                except Exception:  # the dashboard never takes the run down
                    logger.exception("the dashboard could not take a message on %s", topic)


class RunDirectoryFeed:
    """Follows a run directory (a simulation's or serve's `--out`) while it is written."""

    def __init__(self, board: Board, directory: Path, interval_s: float = 0.5) -> None:
        self.board = board
        self.directory = directory
        self.interval_s = interval_s
        self._seen: tuple[tuple[int, int], ...] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-run-dir", daemon=True)

    def start(self) -> RunDirectoryFeed:
        """Read the directory now, then keep following it on a thread of its own."""
        self.poll()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def poll(self) -> bool:
        """Reload the board if any run file changed since the last look; whether it did.

        Until the directory exists the board says it waits for it (a run not started yet).
        """
        if not self.directory.is_dir():
            self._seen = None
            self.board.notice(f"waiting for {self.directory} to appear (the run's --out)")
            return False
        seen = tuple(_stamp(self.directory / name) for name in RUN_FILES)
        if seen == self._seen:
            return False
        self._seen = seen
        self.board.replace_run(**read_run_directory(self.directory))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except OSError as error:  # a directory removed under us: say so, keep trying
                logger.warning("cannot read %s: %s", self.directory, error)


def read_run_directory(directory: Path) -> dict[str, Any]:
    """What a run directory says so far, as `Board.replace_run` takes it.

    Tolerates a run in progress: missing files, a metrics line half written, no summary yet.
    """
    summary = _read_json(directory / "summary.json")
    raw_settings = _read_json(directory / "run.json") or summary or {}
    rounds = deque(read_rounds(directory / "metrics.jsonl"), maxlen=RUN_HISTORY_ROUNDS)
    devices = list(_device_results(directory / "devices.jsonl"))
    fleet_name = str(raw_settings.get("fleet", "default"))
    history = RunHistory(
        fleet=fleet_name,
        run_id=NO_RUN_ID,
        settings=flatten_settings(raw_settings),
        rounds=tuple(rounds),
        devices=tuple(devices),
    )
    fleet = None
    fleet_text = _read_text(directory / "fleet.json")
    if fleet_text:
        try:
            fleet = FleetStatus.model_validate_json(fleet_text)
            check_view_message(fleet, time.time())
        except (ValidationError, PflError) as error:
            fleet = None
            logger.warning("ignored %s: %s", directory / "fleet.json", error)
    total = raw_settings.get("rounds")
    coordinator = CoordinatorStatus(
        state="finished" if summary is not None else "running",
        fleet=fleet_name,
        task=str(raw_settings.get("task", ""))[:256],
        algorithm=str(raw_settings.get("algorithm", ""))[:64],
        round_id=rounds[-1].round_id if rounds else 0,
        rounds=total if isinstance(total, int) and total >= 0 else None,
    )
    return {
        "history": history,
        "fleet": fleet,
        "coordinator": coordinator,
        "finished": summary is not None,
        "summary": _final_cards(summary),
    }


def _final_cards(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the page's final cards read from summary.json (its settings are shown already)."""
    if summary is None:
        return None
    return {key: _finite(value) for key, value in summary.items() if key != "config"}


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinity (JSON cannot carry them) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _stamp(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return (0, -1)
    return (stat.st_mtime_ns, stat.st_size)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    text = _read_text(path)
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # being replaced right now: the next look sees the whole file
    return value if isinstance(value, dict) else None


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    text = _read_text(path) or ""
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being appended
        if isinstance(value, dict):
            yield value


def read_rounds(path: Path) -> Iterator[RoundSummary]:
    """The rounds a metrics.jsonl holds so far (a line being written is skipped)."""
    for line in _lines(path):
        try:
            yield round_summary(line)
        except (KeyError, TypeError, ValidationError) as error:
            logger.debug("skipped a metrics line of %s: %s", path, error)


def _device_results(path: Path) -> Iterator[DeviceResult]:
    for line in _lines(path):
        try:
            yield DeviceResult.model_validate(
                {key: line.get(key) for key in DeviceResult.model_fields if key in line}
            )
        except ValidationError as error:
            logger.debug("skipped a device line of %s: %s", path, error)
