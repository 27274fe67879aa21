"""A DP run killed with SIGKILL and resumed ends as if it had never stopped: model and epsilon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings
from tests.conftest import Mosquitto
from tests.e2e.conftest import Processes, serve_killed_after, serve_settings
from tests.e2e.seeded_noise import seeded_generator

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(300)]
ROUNDS = 4
RUN = {
    "task": "digits",
    "algorithm": "fedavg",
    "seed": 0,
    "rounds": ROUNDS,
    "dp_noise": 0.25,
    "dp_clip": 0.5,
    "dp_sampling": "fixed",
    "dp_adaptive_clip": True,
}


def _settings(url: str, directory: Path, **options: object) -> ServeSettings:
    return serve_settings(url, directory, **RUN, **options)


def _model(directory: Path) -> dict[str, torch.Tensor]:
    record = json.loads((directory / "checkpoint" / "checkpoint.json").read_text())
    return load_file(directory / "checkpoint" / record["tensors_file"])


def test_a_killed_dp_coordinator_resumes_to_the_uninterrupted_model_and_epsilon(
    mosquitto: Mosquitto, processes: Processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: both runs draw their noise from one seed; the uninterrupted one runs first
    monkeypatch.setattr("coordinator.stages.privacy.noise_generator", seeded_generator)
    processes.fleet(mosquitto.url, 3)
    whole = run_serve(_settings(mosquitto.url, tmp_path / "whole"))
    flags = [
        "--broker", mosquitto.url, "--task", "digits", "--algorithm", "fedavg",
        "--seed", "0", "--rounds", str(ROUNDS), "--dp-noise", "0.25", "--dp-clip", "0.5",
        "--dp-sampling", "fixed", "--dp-adaptive-clip", "--min-devices", "3",
        "--round-timeout", "30",
    ]  # fmt: skip
    # Execute: SIGKILL once round 2 is checkpointed, then resume in this process
    killed_at = serve_killed_after(processes, flags, tmp_path / "killed", 2, module="seeded_noise")
    resumed = run_serve(_settings(mosquitto.url, tmp_path / "killed", resume=True))
    # Assert: the resumed run ran the rounds left and ended where the uninterrupted one did
    assert 2 <= killed_at < ROUNDS, processes.log("coordinator")
    assert [r.round_id for r in resumed.records] == list(range(killed_at + 1, ROUNDS + 1))
    for name, tensor in whole.final_shared.items():
        assert torch.equal(resumed.final_shared[name], tensor), name
    final = _model(tmp_path / "killed")
    assert all(torch.equal(final[n], t) for n, t in _model(tmp_path / "whole").items())
    summaries = [
        json.loads((tmp_path / run / "run" / "summary.json").read_text())
        for run in ("whole", "killed")
    ]
    assert summaries[0]["privacy"]["epsilon"] == summaries[1]["privacy"]["epsilon"] > 0
    assert summaries[0]["privacy"]["clip_norm"] == summaries[1]["privacy"]["clip_norm"]
    assert summaries[1]["privacy"]["rounds_released"] == ROUNDS
