"""The MNIST-1D results benchmark: what each cell asks simulate for, and its cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import mnist1d_results
from benchmarks.mnist1d_results import ROWS, cached, cell_path, request, table
from coordinator.run.compare import plan_runs

BY_KEY = {row.key: row for row in ROWS}


def test_partial_rows_pretrain_half_the_rounds_and_name_their_personal_part() -> None:
    fedalt = request("feature-shift", BY_KEY["fedalt-input"], 1)
    fedavg = request("feature-shift", BY_KEY["fedavg"], 1)
    assert (fedalt["pretrain_rounds"], fedalt["rounds"]) == (10, 10)
    assert fedalt["personal"] == ["input.*", "norm*"]
    assert fedavg["rounds"] == 20
    assert "pretrain_rounds" not in fedavg
    assert fedavg["task_options"] == {"shift": "feature"}
    assert request("label-skew", BY_KEY["fedavg"], 0)["partition"] == "shards"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.key)
def test_every_cell_is_a_valid_simulation(row: mnist1d_results.Row) -> None:
    for workload in mnist1d_results.WORKLOADS:
        wanted = request(workload, row, 0)
        overrides = {k: v for k, v in wanted.items() if k not in ("algorithm", "seed")}
        (spec,) = plan_runs([row.algorithm], [0], Path("."), overrides=overrides)
        assert spec.settings.task == "mnist1d"


def test_the_cache_is_used_only_for_the_same_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    monkeypatch.setattr(mnist1d_results, "CACHE", tmp_path)
    row = BY_KEY["ditto"]
    path = cell_path("label-skew", row, 0)
    path.parent.mkdir(parents=True)
    values = {"personalized_mean": 0.5, "personalized_worst10": 0.25, "global": 0.4}
    path.write_text(json.dumps({"request": request("label-skew", row, 0), "values": values}))

    # Execute
    lines = table("label-skew", [row, BY_KEY["local"]], [0])

    # Assert
    assert cached("label-skew", row, 0) == values
    assert cached("label-skew", row, 1) is None
    assert lines[2] == "| Ditto | 50.0 ± 0.0 | 25.0 ± 0.0 | 40.0 ± 0.0 | 1 |"
    assert lines[3] == "| Local | - | - | - | 0 |"
    path.write_text(json.dumps({"request": {"rounds": 1}, "values": values}))
    assert cached("label-skew", row, 0) is None


def test_the_fedbn_rows_train_the_batchnorm_cnn_with_or_without_its_norms_personal() -> None:
    for key, preset in (("fedbn", "fedbn"), ("fedavg-bn", None)):
        wanted = request("feature-shift", BY_KEY[key], 2)
        overrides = {k: v for k, v in wanted.items() if k not in ("algorithm", "seed")}
        (spec,) = plan_runs(["fedavg"], [2], Path("."), overrides=overrides)
        assert spec.settings.task_options == {"shift": "feature", "model": "cnn-bn"}
        assert spec.settings.personal_preset == preset
        assert "pretrain_rounds" not in wanted
