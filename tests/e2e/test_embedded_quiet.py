"""The embedded broker under many quick connections: no amqtt traceback, no false take-over.

Before, 60 virtual devices connecting at once made amqtt take over sessions whose DISCONNECT it
had not handled yet and die iterating a subscription table others were changing; the run then
took a device for a copied id and failed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protocols.transport.amqtt_races import SnapshotTable
from tests.e2e.conftest import child_env

pytestmark = pytest.mark.timeout(900)


def test_a_table_may_change_while_a_loop_walks_it() -> None:
    table = SnapshotTable({"a": 1, "b": 2})
    walked = []
    for key in table:
        table[f"{key}-new"] = 0  # a plain dict raises "changed size during iteration"
        walked.append(key)
    for key, _ in table.items():
        del table[key]
    assert walked == ["a", "b"]
    assert table == {}
    assert isinstance(table.keys(), list)


def test_sixty_devices_on_the_embedded_broker_run_without_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in child_env().items() if not k.startswith("PFL_")}
    done = subprocess.run(
        [
            sys.executable, "-m", "coordinator.cli.app", "simulate", "--task", "digits",
            "--algorithm", "fedavg", "--devices", "60", "--rounds", "2", "--transport", "mqtt",
            "--out", str(tmp_path / "run"),
        ],
        env={**env, "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout=800,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "Traceback" not in said
    assert "take-over" not in said
    assert "dictionary changed size" not in said
    assert "same id" not in said
    assert "lost its connection" not in said
    assert (tmp_path / "run" / "summary.json").is_file()
