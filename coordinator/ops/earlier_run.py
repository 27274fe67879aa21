"""What an earlier run left in a checkpoint or output directory, said so the next step is clear."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from coordinator.run.checkpoint import RECORD_FILE

SUMMARY_FILE = "summary.json"


def earlier_run_problem(checkpoint_dir: Path, out: Path | None) -> str | None:
    """Why a new run may not start over an earlier one's files, or None when there are none.

    A finished run (its summary written, or its checkpoint at its last round) is said to have
    finished, with `--fresh` to start anew; an interrupted one with the round it stopped after
    and `--resume` to continue it.
    """
    record = checkpoint_dir / RECORD_FILE
    metrics = None if out is None else out / "metrics.jsonl"
    found = [str(path) for path in (record, metrics) if path is not None and path.exists()]
    if not found:
        return None
    where = " and ".join(found)
    alternatives = "or use another --checkpoint-dir / --out"
    summary = None if out is None else out / SUMMARY_FILE
    round_id, total = _checkpoint_progress(record)
    if (summary is not None and summary.exists()) or (round_id is not None and round_id == total):
        rounds = "" if round_id is None else f" after round {round_id}"
        return (
            f"the run in {where} finished{rounds}: pass --fresh to start a new run over it "
            f"(its files are replaced), {alternatives}"
        )
    stopped = "" if round_id is None else f" stopped after round {round_id} of {total}"
    return (
        f"an earlier run{stopped} left {where}: pass --resume to continue it or --fresh to "
        f"start over and replace it ({alternatives})"
    )


def _checkpoint_progress(record: Path) -> tuple[int | None, int | None]:
    """The round a checkpoint holds and its run's total, or None where it does not say."""
    try:
        raw = json.loads(record.read_text())
        settings = raw["settings"]
        total = int(settings["rounds"]) + int(settings.get("pretrain_rounds") or 0)
        return int(raw["round_id"]), total
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def interrupted_line(checkpoint_dir: Path, argv: list[str]) -> str:
    """What an interrupted `serve` says: the round its checkpoint holds, and how to go on.

    `argv` is the command line after the program name (`serve ...`); the resume command is
    that line with `--resume` for `--fresh`.
    """
    round_id, total = _checkpoint_progress(checkpoint_dir / RECORD_FILE)
    if round_id is None:
        return "stopped before the first round was checkpointed: nothing to resume"
    words = [word for word in argv if word not in ("--fresh", "--resume")]
    command = shlex.join(["pfl-coord", *words, "--resume"])
    return (
        f"stopped after round {round_id} of {total} (checkpoint in {checkpoint_dir}); "
        f"continue with: {command}"
    )
