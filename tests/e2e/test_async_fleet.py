"""Asynchronous rounds with real agent processes over mosquitto, in real time, and resumed."""

from __future__ import annotations

import pytest

from coordinator.run.serve import run_serve
from coordinator.run.settings import ServeSettings
from tests.e2e.conftest import serve_killed_after
from tests.run_metrics import fleet_metric, metrics_lines

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(150)]


def test_agents_train_asynchronously_and_a_killed_coordinator_resumes(
    mosquitto, processes, tmp_path
) -> None:
    # Prepare: four agents; three train at a time, every two updates make an aggregation
    processes.fleet(mosquitto.url, 4)
    flags = [
        "--broker", mosquitto.url, "--task", "digits", "--algorithm", "fedalt", "--rounds", "6",
        "--mode", "async", "--buffer", "2", "--concurrency", "3", "--max-staleness", "4",
        "--staleness", "hinge:2:1", "--compress", "int8", "--min-devices", "4",
        "--round-timeout", "30",
    ]  # fmt: skip
    # Execute: kill the coordinator once aggregation 3 is checkpointed, then resume in-process
    killed_at = serve_killed_after(processes, flags, tmp_path, 3)
    resumed = run_serve(
        ServeSettings.load(
            None,
            broker=mosquitto.url,
            task="digits",
            algorithm="fedalt",
            rounds=6,
            mode="async",
            buffer=2,
            concurrency=3,
            max_staleness=4,
            staleness="hinge:2:1",
            compress="int8",
            min_devices=4,
            round_timeout=30.0,
            out=tmp_path / "run",
            checkpoint_dir=tmp_path / "checkpoint",
            resume=True,
        )
    )
    # Assert: every aggregation once, each of a full buffer within the staleness bound
    assert 3 <= killed_at < 6, processes.log("coordinator")
    lines = metrics_lines(tmp_path / "run")
    assert [line["round_id"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all(line["participants"] == 2 for line in lines), [
        (line["round_id"], line["participants"], line["dropped"]) for line in lines
    ]
    assert all(0 <= line["scalars"]["staleness_max"] <= 4 for line in lines)
    assert "sim_seconds" not in lines[0]  # real time
    assert resumed.records[0].round_id == killed_at + 1
    assert resumed.summary.metrics is not None
    assert fleet_metric(resumed.summary) > 0.5
    assert len(resumed.reports) == 4  # every device evaluated its personalized model
