"""Securely aggregated runs end to end: the plain run's model, DP on top, refusals, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import SimulationResult, run_simulation

pytestmark = pytest.mark.slow
BASE = {"task": "digits", "devices": 12, "rounds": 3, "seed": 2, "workers": 1}


def _run(**options: Any) -> SimulationResult:
    return run_simulation(SimulationSettings.load(None, **{**BASE, **options}))


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedalt", "ditto", "pfedbred"])
def test_a_secure_run_trains_the_model_the_plain_run_trains(algorithm: str) -> None:
    plain, secure = _run(algorithm=algorithm), _run(algorithm=algorithm, secagg=True)
    for name, tensor in plain.final_shared.items():
        assert torch.allclose(secure.final_shared[name], tensor, atol=1e-4), name
    assert [r.participants for r in secure.records] == [12, 12, 12]
    assert all(r.scalars["secagg_survivors"] == 12 for r in secure.records)
    assert all("update_norm_median" not in r.scalars for r in secure.records)
    losses = [
        (p.train_loss, s.train_loss) for p, s in zip(plain.records, secure.records, strict=True)
    ]
    assert all(abs(p - s) < 1e-3 for p, s in losses)  # the mean loss is summed securely too


def test_secagg_with_a_sparse_ring_and_sampled_cohorts() -> None:
    result = _run(devices=24, participation=0.5, secagg=True, secagg_neighbors=6)
    assert [r.participants for r in result.records] == [12, 12, 12]


def test_device_placed_dp_under_secure_aggregation_reports_epsilon() -> None:
    result = _run(
        devices=30,
        secagg=True,
        dp_noise=1.0,
        dp_placement="device",
        dp_adaptive_clip=True,
        participation=0.5,
    )
    assert result.summary.privacy is not None
    epsilons = [r.scalars["dp_epsilon"] for r in result.records]
    assert epsilons == sorted(epsilons)
    assert epsilons[0] > 0
    assert all("dp_within_clip" in r.scalars for r in result.records)
    assert result.records[-1].scalars["dp_clip_norm"] != 1.0  # the clip adapted from the sum
    assert all(r.scalars["secagg_survivors"] == r.participants for r in result.records)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"algorithm": "selffl"}, "secure aggregation: selffl"),
        ({"algorithm": "federico"}, "secure aggregation: federico"),
        ({"compress": "topk:0.1"}, "top-k"),
        ({"algorithm_options": {"robust_aggregation": "median"}}, "robust_aggregation"),
    ],
)
def test_what_secure_aggregation_cannot_do_is_refused_before_any_round(
    options: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        _run(secagg=True, **options)


def test_cli_over_the_embedded_mqtt_broker(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "coordinator.cli.app", "simulate", "--transport", "mqtt",
        "--devices", "5", "--rounds", "2", "--secagg", "--out", str(tmp_path), "--workers", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["scalars"]["secagg_survivors"] for line in lines] == [5.0, 5.0]
    assert "rejected" not in done.stdout


def test_the_distributed_discrete_gaussian_runs_sampled_and_is_counted_by_its_own_bound() -> None:
    options = {
        "devices": 16,
        "participation": 0.5,
        "secagg": True,
        "dp_noise": 1.0,
        "dp_placement": "device",
    }
    discrete = _run(**options, dp_distribution="discrete-gaussian")
    gaussian = _run(**options)
    for ring, real in zip(discrete.records, gaussian.records, strict=True):
        assert ring.scalars["secagg_survivors"] == ring.participants
        # z sqrt(k/m) with k the survivors, m = 8 expected; the rounding takes off under 1e-4
        z = ring.scalars["dp_noise_multiplier"]
        assert z == pytest.approx((ring.participants / 8) ** 0.5, rel=1e-4)
        assert "dp_epsilon_pld" not in ring.scalars
        # the same draws; Zhu and Wang's bound holds for any mechanism, above the Gaussian's
        assert ring.participants == real.participants
        assert ring.scalars["dp_epsilon"] > real.scalars["dp_epsilon_rdp"]
    epsilons = [r.scalars["dp_epsilon"] for r in discrete.records]
    assert epsilons == sorted(epsilons)
    assert all(e < 100 for e in epsilons)


def test_the_discrete_gaussian_without_device_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="placement device"):
        _run(secagg=True, dp_noise=1.0, dp_distribution="discrete-gaussian")
