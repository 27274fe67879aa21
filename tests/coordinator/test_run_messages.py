"""What `pfl-coord` prints when a run cannot start, did nothing, or repeats itself: one clear line.

Each test runs the real command as a process and reads what it printed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from coordinator.ops.earlier_run import earlier_run_problem, interrupted_line
from coordinator.ops.run_outcome import ALL_SKIPPED_EXIT

REPO = Path(__file__).resolve().parents[2]
UNSCALED_TASK = '''"""Digits with raw pixel values times 1000: inputs nobody scaled."""

import pfl_tasks.digits as digits

_scaled_pool = digits.load_digits_pool


def _unscaled_pool():
    pixels, labels = _scaled_pool()
    return pixels * 16000.0, labels


digits.load_digits_pool = _unscaled_pool
UnscaledDigits = digits.DigitsTask
'''


def pfl_coord(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`pfl-coord ARGUMENTS` in `cwd`, on a wide terminal, with no PFL_ variables around."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PFL_")}
    env.update(
        COLUMNS="250",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(cwd), str(REPO), env.get("PYTHONPATH", "")]),
    )
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli.app", *arguments],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_taken_port_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = pfl_coord("serve", "--port", str(port), "--out", "run", cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    assert "Broker startup failed" not in output
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert f"127.0.0.1:{port}: the port is already in use" in line
    assert "--port" in line
    assert len(output.strip().splitlines()) <= 2, output  # the error, and the progress bar


def _finished_run(tmp_path: Path, round_id: int, *, summary: bool) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    record = {"round_id": round_id, "settings": {"rounds": 4, "pretrain_rounds": 1}}
    (checkpoint / "checkpoint.json").write_text(json.dumps(record))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    if summary:
        (tmp_path / "run" / "summary.json").write_text("{}")


def test_a_finished_runs_checkpoint_says_the_run_finished(tmp_path: Path) -> None:
    _finished_run(tmp_path, 5, summary=True)
    done = pfl_coord("serve", "--out", "run", "--checkpoint-dir", "checkpoint", cwd=tmp_path)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output
    assert "finished after round 5: pass --fresh to start a new run over it" in output
    assert "--resume" not in output
    assert "Traceback" not in output


def test_an_interrupted_runs_checkpoint_names_its_round_and_resume(tmp_path: Path) -> None:
    _finished_run(tmp_path, 2, summary=False)
    problem = earlier_run_problem(tmp_path / "checkpoint", tmp_path / "run")
    assert problem is not None
    assert "stopped after round 2 of 5" in problem
    assert "pass --resume to continue it or --fresh" in problem
    (tmp_path / "run" / "summary.json").write_text("{}")  # a DP run may finish early
    finished = earlier_run_problem(tmp_path / "checkpoint", tmp_path / "run")
    assert "finished after round 2: pass --fresh" in str(finished)
    assert earlier_run_problem(tmp_path / "elsewhere", None) is None


def test_an_interrupted_line_gives_the_resume_command() -> None:
    assert "nothing to resume" in interrupted_line(Path("/nonexistent"), ["serve"])


def test_a_run_whose_rounds_were_all_skipped_warns_and_fails(tmp_path: Path) -> None:
    (tmp_path / "unscaled_digits.py").write_text(UNSCALED_TASK)
    done = pfl_coord(
        "simulate", "--task", "unscaled_digits:UnscaledDigits", "--algorithm", "fedavg",
        "--devices", "3", "--rounds", "3", "--out", "run", cwd=tmp_path,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == ALL_SKIPPED_EXIT, output
    (warning,) = [line for line in output.splitlines() if line.startswith("warning:")]
    assert "all 3 round(s) were skipped" in warning
    assert "unscaled inputs" in warning
    assert "docs/troubleshooting.md" in warning
    # the guard's per-device notes: once per device and kind, not every round
    notes = [line for line in output.splitlines() if "clipped to" in line]
    devices = [line.split(": ")[1] for line in notes]
    assert len(devices) == len(set(devices)), notes


def test_a_weight_cap_is_said_once_not_every_round(tmp_path: Path) -> None:
    done = pfl_coord(
        "simulate", "--task", "digits", "--algorithm", "fedavg", "--devices", "2",
        "--rounds", "4", "--out", "run", cwd=tmp_path,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    capped = [line for line in output.splitlines() if "weight capped" in line]
    assert len(capped) == 1, output
    assert "said once per device" in capped[0]
    rounds = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["scalars"].get("guard_cut") for r in rounds] == [1.0] * 4  # still every round
