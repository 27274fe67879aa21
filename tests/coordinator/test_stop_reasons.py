"""A run that stops early says why in summary.json; every round records when it finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation

DP = {"task": "digits", "devices": 10, "participation": 0.5, "dp_noise": 1.0, "seed": 3}


def _run(out: Path, **options: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run_simulation(SimulationSettings.load(None, **{**DP, "workers": 1, "out": out, **options}))
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def test_a_run_stopped_by_its_budget_says_so_and_a_full_run_has_no_stop_reason(
    tmp_path: Path,
) -> None:
    # Prepare: the epsilon a two-round run spends, and a budget between its rounds' spending
    full, records = _run(tmp_path / "full", rounds=2)
    first, second = (r["scalars"]["dp_epsilon"] for r in records)
    budget = (first + second) / 2

    # Execute
    stopped, kept = _run(tmp_path / "stopped", rounds=2, dp_epsilon=budget)

    # Assert: one round ran; the summary says why the second did not
    assert "stop_reason" not in full
    assert [r["round_id"] for r in kept] == [1]
    assert stopped["stop_reason"] == (
        "stopped after round 1 of 2: another round would pass the privacy budget "
        f"(epsilon {first:.2f} of {budget:.2f} spent)"
    )


def test_every_round_line_records_when_it_finished(tmp_path: Path) -> None:
    _, records = _run(tmp_path, rounds=3, dp_noise=None)

    finished = [r["finished_at"] for r in records]
    assert finished == sorted(finished)
    assert finished[0] > 1_600_000_000  # epoch seconds, not a run-relative clock
