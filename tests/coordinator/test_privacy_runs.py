"""Differentially private runs end to end: epsilon per round, the budget, workers, MQTT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation

pytestmark = pytest.mark.slow
DP = {"task": "digits", "devices": 30, "participation": 0.5, "dp_noise": 1.0, "seed": 3}


def _run(**options: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    settings = SimulationSettings.load(None, **{**DP, "rounds": 4, "workers": 1, **options})
    result = run_simulation(settings)
    assert result.summary.privacy is not None
    return dict(result.summary.privacy), [r.as_json() for r in result.records]


def test_epsilon_is_reported_every_round_and_grows() -> None:
    privacy, records = _run(algorithm="fedalt")
    epsilons = [r["scalars"]["dp_epsilon"] for r in records]
    assert epsilons == sorted(epsilons)
    assert epsilons[0] > 0
    assert privacy["epsilon"] == epsilons[-1]
    assert privacy["rounds_released"] == 4
    assert all(r["train_loss"] is None for r in records)  # devices do not report it under DP
    for record in records:  # both accountants each round, the tighter reported
        scalars = record["scalars"]
        assert scalars["dp_epsilon"] == min(scalars["dp_epsilon_rdp"], scalars["dp_epsilon_pld"])
    assert all("update_norm_median" not in r["scalars"] for r in records)


def test_a_poisson_draw_of_nobody_is_a_round_that_releases_noise_and_counts() -> None:
    """6 devices at rate 0.1: about half the draws are empty, and each is still a round.

    The model moves by the noise alone and the accountant counts it, as the analysis assumes.
    """
    privacy, records = _run(devices=6, participation=0.1, rounds=4, seed=1)
    assert [r["participants"] for r in records].count(0) >= 1
    assert privacy["rounds_released"] == 4
    assert [r["round_id"] for r in records] == [1, 2, 3, 4]
    assert all(r["scalars"]["dp_noise_multiplier"] == 1.0 for r in records)
    assert all("aggregate_rejected" not in r["scalars"] for r in records)


def test_the_run_stops_before_passing_its_epsilon_budget() -> None:
    _, unbounded = _run(rounds=8)
    budget = (unbounded[2]["scalars"]["dp_epsilon"] + unbounded[3]["scalars"]["dp_epsilon"]) / 2
    privacy, records = _run(rounds=8, dp_epsilon=budget)
    assert len(records) == 3
    assert privacy["epsilon"] <= budget
    assert records[-1]["evaluation"] is not None  # the model so far is evaluated


def test_device_noise_and_adaptive_clipping_do_not_depend_on_the_worker_count() -> None:
    options = {
        "algorithm": "fedalt",
        "dp_placement": "device",
        "secagg": True,  # device-placed noise runs only under secure aggregation
        "dp_adaptive_clip": True,
    }
    (privacy_one, one), (privacy_two, two) = _run(**options), _run(**{**options, "workers": 2})
    clocked = ("wall_seconds", "bytes_up", "bytes_down")  # headers carry the time they were sent
    timeless = [{k: v for k, v in r.items() if k not in clocked} for r in one]
    assert timeless == [{k: v for k, v in r.items() if k not in clocked} for r in two]
    assert privacy_one == privacy_two
    assert one[-1]["scalars"]["dp_clip_norm"] != 1.0  # the clip moved


def test_cli_over_the_embedded_mqtt_broker_prints_epsilon(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "coordinator.cli.app", "simulate", "--transport", "mqtt",
        "--devices", "6", "--rounds", "2", "--dp-noise", "1.5", "--dp-placement", "device",
        "--secagg", "--out", str(tmp_path), "--workers", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "DP epsilon (delta 1e-05)" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["privacy"]["rounds_released"] == 2
    assert summary["privacy"]["placement"] == "device"


def test_refused_algorithms_fail_before_any_round(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "coordinator.cli.app", "simulate", "--algorithm", "selffl",
        "--dp-noise", "1", "--devices", "4", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "differential privacy: selffl" in done.stdout + done.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
