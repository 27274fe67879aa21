"""The agent without the coordinator's packages: an install of `pfl-edge` alone, not `[coord]`.

Every child here runs with tests/lean_site on PYTHONPATH, whose sitecustomize makes the `coord`
extra's packages (protocols.extras.COORD_ONLY) raise ModuleNotFoundError on import, as on a
board that never installed them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import ServeSettings
from pfl_tasks.base import PartitionSpec
from pfl_tasks.datadir import save_device_data
from pfl_tasks.registry import load_task
from protocols.extras import COORD_ONLY, EXTRA_LINE
from tests.conftest import free_port, wait_for_port
from tests.e2e.conftest import CEILING_S, REPO, Processes, account_flags, child_env

pytestmark = pytest.mark.timeout(600)
LEAN_SITE = REPO / "tests" / "lean_site"
AGENT_MODULES = (
    *("device_agent.cli", "device_agent.agent", "device_agent.runner", "device_agent.training"),
    *("device_agent.exporting", "device_agent.pool", "device_agent.offline_export"),
)


def lean_env() -> dict[str, str]:
    """A child's environment in which the coordinator-only packages cannot be imported."""
    env = child_env()
    env["PYTHONPATH"] = f"{LEAN_SITE}:{env['PYTHONPATH']}"
    env["PFL_TEST_UNIMPORTABLE"] = ",".join(COORD_ONLY)
    return env


def lean_run(*args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in a lean child, its output captured."""
    return subprocess.run(
        [sys.executable, *args], env=lean_env(), capture_output=True, text=True, timeout=CEILING_S
    )


def test_the_lean_site_makes_each_coordinator_package_unimportable() -> None:
    probe = (
        "import importlib, json\n"
        "def absent(name):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        return True\n"
        "    return False\n"
        f"print(json.dumps({{n: absent(n) for n in {sorted(COORD_ONLY)!r} + ['numpy']}}))\n"
    )
    done = lean_run("-c", probe)
    assert done.returncode == 0, done.stderr
    absent = json.loads(done.stdout)
    assert absent.pop("numpy") is False  # the agent's own packages still import
    assert set(absent.values()) == {True}, absent


def test_the_agents_import_path_needs_no_coordinator_package() -> None:
    code = (
        "import json, sys\n"
        + "".join(f"import {module}\n" for module in AGENT_MODULES)
        + "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = lean_run("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout))
    assert "coordinator" not in loaded
    assert {"torch", "paho"} <= loaded
    assert not {"onnx", "onnxruntime"} & loaded  # they load with an export
    helped = lean_run("-m", "device_agent.cli", "start", "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "--data-shard" in helped.stdout


def test_a_lean_agent_given_a_builtin_digits_shard_names_the_extra(tmp_path: Path) -> None:
    done = lean_run(
        *("-m", "device_agent.cli", "start", "--task", "digits", "--device-id", "d"),
        *("--data-shard", "0", "--num-shards", "3", "--broker", "mqtt://127.0.0.1:9"),
        *("--state-dir", str(tmp_path / "state")),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert "scikit-learn is not installed: this install is the device agent's" in said
    assert EXTRA_LINE in said
    assert "Traceback" not in done.stderr


def test_pfl_coord_on_an_agent_install_names_the_extra(tmp_path: Path) -> None:
    helped = lean_run("-m", "coordinator.cli.entry", "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]  # the CLI itself imports none of them
    done = lean_run(
        *("-m", "coordinator.cli.entry", "simulate", "--task", "digits", "--devices", "2"),
        *("--rounds", "1", "--out", str(tmp_path / "run")),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert "scikit-learn is not installed" in said
    assert EXTRA_LINE in said
    assert "Traceback" not in done.stderr


def test_pfl_coord_with_every_package_runs_as_before() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli.entry", "--help"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=CEILING_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulate" in done.stdout


def test_a_lean_agent_trains_a_round_against_a_served_run(tmp_path: Path) -> None:
    # Prepare: the device's own data on disk (a board's --data DIR), a served one-round run on
    # the embedded broker in this process, and the agent as a lean child process
    shard = load_task("digits").make_fleet(3, PartitionSpec(), 0)[1]
    save_device_data(shard, tmp_path / "data")
    port = free_port()
    settings = ServeSettings.load(
        None,
        **{"task": "digits", "algorithm": "fedavg", "rounds": 1, "min_devices": 1},
        **{"port": port, "join_timeout": CEILING_S, "round_timeout": CEILING_S},
        **{"out": tmp_path / "run", "checkpoint_dir": tmp_path / "checkpoint"},
    )
    served: list[ServeResult] = []
    thread = threading.Thread(target=lambda: served.append(run_serve(settings)), daemon=True)
    thread.start()
    assert wait_for_port(port, timeout_s=CEILING_S)
    processes = Processes(tmp_path)
    try:
        command = [
            sys.executable, "-m", "device_agent.cli", "start", "--task", "digits",
            "--broker", f"mqtt://127.0.0.1:{port}", "--device-id", "board-1",
            "--data", str(tmp_path / "data"), "--state-dir", str(tmp_path / "state"),
            *account_flags(tmp_path / "run" / "broker" / "device.env"),
        ]  # fmt: skip
        processes.start("board-1", command, env=lean_env())
        # Execute
        thread.join(CEILING_S)
    finally:
        processes.stop_all()
    # Assert: the round closed with the lean agent's update in it
    assert served, processes.log("board-1")[-3000:]
    (record,) = served[0].records
    assert record.participants == 1, processes.log("board-1")[-3000:]
    assert math.isfinite(record.train_loss)
    assert "Traceback" not in processes.log("board-1")
