"""DP-FTRL's tree aggregation with real agent processes over mosquitto."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.run.serve import ServeResult, run_serve
from coordinator.run.settings import ServeSettings, SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.stages.accountant import DpRound
from coordinator.stages.tree_accountant import TreeAccountant
from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes, serve_killed_after, serve_settings
from tests.run_metrics import metrics_lines

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(900)]
RUN = {
    "task": "digits",
    "algorithm": "fedavg",
    "seed": 0,
    "rounds": 3,
    "dp_mechanism": "ftrl-tree",
    "dp_clip": 0.5,
}


def _settings(url: str, tmp_path: Path, **options: object) -> ServeSettings:
    return serve_settings(url, tmp_path, **{**RUN, **options})


def _serve(url: str, processes: Processes, tmp_path: Path, **options: object) -> ServeResult:
    processes.fleet(url, 3)
    return run_serve(_settings(url, tmp_path, **options))


def test_three_agents_serve_ftrl_tree_and_report_its_epsilon(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path
) -> None:
    # Execute
    _serve(mosquitto.url, processes, tmp_path, dp_noise=3.0)
    out = tmp_path / "run"
    # Assert: every round in metrics.jsonl carries the tree accountant's epsilon
    lines = metrics_lines(out)
    independent = TreeAccountant(1e-5, None, None)
    for line in lines:
        spent = independent.record(DpRound(3.0, 3, 3.0))
        assert (line["selected"], line["participants"]) == (3, 3)
        assert line["scalars"]["dp_epsilon"] == pytest.approx(spent.tighter)
        assert line["scalars"]["dp_epsilon_pld"] == pytest.approx(spent.pld)
        assert line["train_loss"] is None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["mechanism"] == "ftrl-tree"
    assert summary["privacy"]["rounds_released"] == 3


def test_without_noise_serving_ftrl_tree_gives_the_simulations_model(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path
) -> None:
    """At z = 0 the tree adds nothing: the real fleet's model is the simulated one, bit for bit."""
    # Execute
    served = _serve(mosquitto.url, processes, tmp_path, dp_noise=0.0, secagg=True)
    simulated = run_simulation(
        SimulationSettings.load(None, **RUN, dp_noise=0.0, secagg=True, devices=3, batched="off")
    )
    # Assert
    assert [r.scalars["secagg_survivors"] for r in served.records] == [3.0, 3.0, 3.0]
    for name, tensor in simulated.final_shared.items():
        assert torch.equal(served.final_shared[name], tensor), name
    assert served.summary.metrics == simulated.summary.metrics


def test_a_killed_ftrl_tree_coordinator_resumes_its_tree_and_its_epsilon(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path
) -> None:
    """The CLI run is killed after a checkpoint; the resumed one continues the same accounting."""
    # Prepare
    processes.fleet(mosquitto.url, 3)
    flags = [
        "--broker", mosquitto.url, "--task", "digits", "--algorithm", "fedavg", "--rounds", "5",
        "--min-devices", "3", "--round-timeout", "20", "--dp-noise", "3", "--dp-clip", "0.5",
        "--dp-mechanism", "ftrl-tree",
    ]  # fmt: skip
    # Execute: kill it once round 2 is checkpointed, then resume in-process
    killed_at = serve_killed_after(processes, flags, tmp_path, 2)
    state = json.loads((tmp_path / "checkpoint" / "checkpoint.json").read_text())["stages"][
        "privacy"
    ]
    resumed = run_serve(_settings(mosquitto.url, tmp_path, rounds=5, dp_noise=3.0, resume=True))
    # Assert: rounds 1..5 once each, every epsilon that of its round count in one tree
    assert 2 <= killed_at < 5, processes.log("coordinator")
    assert state["tree"]["rounds"] == killed_at
    assert resumed.records[0].round_id == killed_at + 1
    lines = metrics_lines(tmp_path / "run")
    assert [line["round_id"] for line in lines] == [1, 2, 3, 4, 5]
    independent = TreeAccountant(1e-5, None, None)
    for line in lines:
        assert line["scalars"]["dp_epsilon"] == pytest.approx(
            independent.record(DpRound(3.0, 3, 3.0)).tighter
        )
    assert resumed.summary.privacy is not None
    assert resumed.summary.privacy["rounds_released"] == 5
