"""Tests for the run summary: one typed record, written as the summary.json both programs wrote."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from coordinator.run.summary import RunSummary

SERVE_KEYS = {
    "algorithm",
    "task",
    "metric_name",
    "devices",
    "rounds",
    "pretrain_rounds",
    "seed",
    "participation",
    "metrics",
    "personalization",
    "wall_seconds",
    "bytes_up",
    "bytes_down",
    "rejected_messages",
    "config",
}


def _served() -> RunSummary:
    return RunSummary(
        algorithm="fedalt",
        task="digits",
        metric_name="accuracy",
        devices=3,
        rounds=4,
        pretrain_rounds=1,
        seed=7,
        participation=0.5,
        metrics=None,
        personalization=None,
        wall_seconds=1.25,
        bytes_up=1_000,
        bytes_down=2_000,
        rejected_messages=0,
        config={"name": "fedalt", "lr": 0.05},
    )


def test_a_served_run_writes_its_keys_and_keeps_missing_metrics_as_null(tmp_path) -> None:
    # Execute
    path = _served().write(tmp_path)
    # Assert
    document = json.loads(path.read_text())
    assert path == tmp_path / "summary.json"
    assert set(document) == SERVE_KEYS
    assert document["metrics"] is None
    assert document["personalization"] is None
    assert document["config"] == {"name": "fedalt", "lr": 0.05}


def test_a_simulation_adds_its_split_and_the_export_only_when_there_was_one(tmp_path) -> None:
    # Prepare
    simulated = replace(
        _served(),
        metrics={"personalized_mean": 0.8, "global": None},
        personalization={"devices": 3, "helped": 2, "hurt": 1, "mean_gain": 0.1},
        stateless=False,
        partition="dirichlet",
        alpha=0.5,
    )
    exported = replace(simulated, export={"ok": 3, "failed": 0, "total_bytes": 99})
    # Execute
    plain, with_export = simulated.as_json(), exported.as_json()
    # Assert
    assert set(plain) == SERVE_KEYS | {"stateless", "partition", "alpha"}
    assert plain["stateless"] is False  # a falsy value is still written
    assert set(with_export) == set(plain) | {"export"}
    assert with_export["export"]["ok"] == 3


def test_the_file_is_the_sorted_indented_json_of_the_summary_as_before(tmp_path) -> None:
    # Prepare: a diverged run's NaN must survive as it always did
    summary = replace(_served(), metrics={"personalized_mean": math.nan, "global": 0.5})
    # Execute
    text = summary.write(tmp_path).read_text()
    # Assert
    assert text == json.dumps(summary.as_json(), indent=2, sort_keys=True)
    assert '"personalized_mean": NaN' in text


def test_the_summary_reads_by_attribute_and_as_its_json_mapping() -> None:
    summary = _served()
    assert summary.bytes_down == summary["bytes_down"] == 2_000
    assert dict(summary) == summary.as_json()
    assert summary.get("export") is None
    assert "partition" not in summary
    assert len(summary) == len(SERVE_KEYS)
