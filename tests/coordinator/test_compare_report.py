"""`pfl-coord compare` and `pfl-coord report` on a tiny workload: table files and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.cli.app import app
from coordinator.ops.report import build_report
from coordinator.run.compare import parse_algorithms, parse_seeds, plan_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--task", "digits", "--devices", "4", "--rounds", "2"]
PLOTS = ("accuracy.png", "train_loss.png", "device_histogram.png", "gain_vs_samples.png")


@pytest.fixture(scope="module")
def compare_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "cmp"
    result = CliRunner().invoke(
        app,
        ["compare", "--algorithms", "local,fedavg-ft", "--seeds", "2", *TINY, "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    return out


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000, path
    assert data.startswith(PNG_MAGIC), path


@pytest.mark.slow
def test_compare_writes_a_row_per_algorithm_with_mean_and_std(compare_dir: Path) -> None:
    # Assert: the markdown table has a row per algorithm, "mean ± std" cells
    lines = (compare_dir / "comparison.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| algorithm"))
    assert "personalized mean" in header
    assert "bytes up / round" in header
    assert "wall s" in header
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert {"local", "fedavg-ft"} <= set(rows)
    assert "±" in rows["fedavg-ft"]
    assert "mean ± std" in "\n".join(lines)
    # Assert: the CSV parses, with _mean and _std columns; local has no global model
    with (compare_dir / "comparison.csv").open() as handle:
        table = {row["algorithm"]: row for row in csv.DictReader(handle)}
    assert set(table) == {"local", "fedavg-ft"}
    for row in table.values():
        assert row["runs"] == "2"
        assert 0 < float(row["personalized_mean_mean"]) <= 1
        assert float(row["personalized_mean_std"]) >= 0
        assert float(row["bytes_up_per_round_mean"]) > 0
        assert float(row["wall_seconds_mean"]) > 0
    assert table["local"]["global_mean"] == ""
    assert 0 < float(table["fedavg-ft"]["global_mean"]) <= 1
    # Assert: each run has its own directory with per-round accuracy (eval_every defaulted)
    for algorithm in ("local", "fedavg-ft"):
        for seed in (0, 1):
            run = compare_dir / algorithm / f"seed-{seed}"
            rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            assert [r["round_id"] for r in rounds] == [1, 2]
            assert all(r["evaluation"] for r in rounds)
            assert json.loads((run / "summary.json").read_text())["seed"] == seed
    with (compare_dir / "runs.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 4


@pytest.mark.slow
def test_report_plots_a_compare_dir_and_a_single_run(compare_dir: Path) -> None:
    # Execute: the whole compare directory, then one run directory on its own
    result = CliRunner().invoke(app, ["report", str(compare_dir)])
    single = build_report(compare_dir / "fedavg-ft" / "seed-0")
    # Assert
    assert result.exit_code == 0, result.output
    for name in PLOTS:
        _assert_png(compare_dir / "plots" / name)
        _assert_png(compare_dir / "fedavg-ft" / "seed-0" / "plots" / name)
    assert single.algorithms == ["fedavg-ft"]
    assert single.skipped == []


def test_report_of_a_local_run_skips_the_gain_plot(tmp_path: Path) -> None:
    # Prepare: a hand-written run of `local` (no global model)
    run = tmp_path / "run"
    run.mkdir()
    rounds = [
        {"round_id": r, "train_loss": 1.0 / r, "evaluation": {"personalized_mean": 0.5 + r / 10}}
        for r in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rounds))
    devices = [
        {"device_id": f"d{i}", "metric_name": "accuracy", "personalized": 0.6 + i / 20,
         "global_model": None, "num_train_samples": 10 * (i + 1), "num_test_samples": 5}
        for i in range(5)
    ]  # fmt: skip
    (run / "devices.jsonl").write_text("".join(json.dumps(x) + "\n" for x in devices))
    (run / "summary.json").write_text(json.dumps({"algorithm": "local", "task": "digits"}))
    # Execute
    report = build_report(run)
    # Assert
    assert [p.name for p in report.plots] == [
        "accuracy.png",
        "train_loss.png",
        "device_histogram.png",
    ]
    assert len(report.skipped) == 1
    assert report.skipped[0].startswith("gain_vs_samples.png")
    for path in report.plots:
        _assert_png(path)


def test_report_of_a_directory_without_runs_fails_clearly(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "no metrics.jsonl" in result.output


def test_unknown_algorithm_fails_fast_with_the_valid_names(tmp_path: Path) -> None:
    # Execute
    result = CliRunner().invoke(
        app, ["compare", "--algorithms", "fedavg,fedavgg", "--out", str(tmp_path / "x")]
    )
    # Assert: nothing ran
    assert result.exit_code == 2
    assert "fedavgg" in result.output
    assert "fedavg-ft" in result.output
    assert not (tmp_path / "x").exists()


def test_compare_takes_the_model_as_simulate_does(tmp_path: Path) -> None:
    # Execute: a model the task offers, then one it does not
    ran = CliRunner().invoke(
        app,
        ["compare", "--algorithms", "fedavg", "--seeds", "1", *TINY, "--model", "linear",
         "--out", str(tmp_path / "ok")],
    )  # fmt: skip
    refused = CliRunner().invoke(
        app,
        ["compare", "--algorithms", "fedavg", *TINY, "--model", "cnn",
         "--out", str(tmp_path / "x")],
    )  # fmt: skip
    # Assert: the runs used the linear model; the unknown one named the valid models, ran nothing
    assert ran.exit_code == 0, ran.output
    settings = json.loads((tmp_path / "ok" / "fedavg" / "seed-0" / "run.json").read_text())
    assert settings["task_options"] == {"model": "linear"}
    assert refused.exit_code == 2
    assert "valid models: mlp, split-input, linear" in refused.output
    assert not (tmp_path / "x").exists()


def test_seeds_and_eval_every_defaults(tmp_path: Path) -> None:
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("4,7") == [4, 7]
    for bad in ("0", "-1", "a", "1,1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)
    with pytest.raises(ValueError, match="given twice"):
        parse_algorithms("fedavg,fedavg")
    specs = plan_runs(["fedavg"], [0], tmp_path, overrides={"rounds": 30, "pretrain_rounds": 10})
    assert specs[0].settings.eval_every == 4
    assert specs[0].settings.out == tmp_path / "fedavg" / "seed-0"
    kept = plan_runs(["fedavg"], [0], tmp_path, overrides={"rounds": 30, "eval_every": 7})
    assert kept[0].settings.eval_every == 7
