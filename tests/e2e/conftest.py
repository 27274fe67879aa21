"""Real agent processes (`python -m device_agent.cli start`) around a coordinator under test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from coordinator.run.settings import ServeSettings
from coordinator.run.simulate import device_name

E2E_DIR = Path(__file__).resolve().parent
REPO = E2E_DIR.parent.parent
CEILING_S: Final = 240.0
"""How long an awaited event may take on a loaded machine (both cores busy): a ceiling that
only a failure reaches, never a measure of speed."""


def wait_for(condition: Callable[[], bool], what: str, ceiling_s: float = CEILING_S) -> None:
    """Poll until `condition` holds; fail naming `what` once the generous ceiling is reached."""
    deadline = time.monotonic() + ceiling_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not seen within {ceiling_s:g} s: {what}")
        time.sleep(0.1)


def child_env() -> dict[str, str]:
    """The environment of child processes: one torch thread, the test task module importable."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(E2E_DIR), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


def sourced(path: Path) -> dict[str, str]:
    """What `set -a; . FILE; set +a` exports: the KEY=VALUE lines of an env file."""
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def with_sourced_files(commands: list[list[str]]) -> list[tuple[list[str], str | None]]:
    """Each documented command with the env file a `. FILE` line before it sourced (or None)."""
    current: str | None = None
    paired: list[tuple[list[str], str | None]] = []
    for words in commands:  # `set -a; . FILE; set +a` is one line, split at spaces only
        if words[:1] == ["set"] and "." in words:
            current = words[words.index(".") + 1].rstrip(";")
        elif words[:1] != ["set"]:
            paired.append((words, current))
    return paired


def account_flags(path: Path) -> tuple[str, ...]:
    """`--username`/`--password` flags from a run's env file (e.g. the embedded broker's)."""
    env = sourced(path)
    return ("--username", env["PFL_USERNAME"], "--password", env["PFL_PASSWORD"])


class Processes:
    """Child processes of one test, killed at teardown whatever happened."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self._all: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        """Start `command` with its output in <tmp>/<name>.log."""
        with (self.directory / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=self.directory
            )
        self.running[name] = process
        self._all.append(process)
        return process

    def agent(
        self,
        url: str,
        index: int,
        *,
        shards: int,
        task: str = "digits",
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """Start the agent a simulation would call device_name(index), on shard `index`."""
        device_id = device_name(index)
        command = [
            sys.executable, "-m", "device_agent.cli", "start",
            "--broker", url, "--device-id", device_id, "--task", task,
            "--data-shard", str(index), "--num-shards", str(shards),
            "--state-dir", str(self.directory / "state" / device_id), *extra,
        ]  # fmt: skip
        return self.start(device_id, command)

    def log(self, name: str) -> str:
        """What a child printed so far."""
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        """SIGTERM everyone, then SIGKILL whoever is still there."""
        for process in self._all:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self._all:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    children = Processes(tmp_path)
    yield children
    children.stop_all()


def serve_settings(url: str, directory: Path, **options: Any) -> ServeSettings:
    """A serve run of three agents over `url`, its metrics and checkpoint under `directory`."""
    return ServeSettings.load(
        None,
        **options,
        broker=url,
        min_devices=3,
        round_timeout=30.0,
        join_timeout=60.0,
        out=directory / "run",
        checkpoint_dir=directory / "checkpoint",
    )


def kill_after_checkpoint(process: subprocess.Popen[bytes], checkpoint: Path, round_id: int) -> int:
    """SIGKILL a serving coordinator once its checkpoint reaches `round_id` (at most 60 s on).

    Returns:
        The round its last checkpoint holds.
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if checkpoint.exists() and json.loads(checkpoint.read_text())["round_id"] >= round_id:
            break
        time.sleep(0.01)
    process.kill()
    process.wait(timeout=10)
    return int(json.loads(checkpoint.read_text())["round_id"])
