"""What a finished run wrote and measured, as tests compare it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.run.summary import RunSummary


def fleet_metric(summary: RunSummary, name: str = "personalized_mean") -> float:
    """`summary.metrics[name]`; a run that evaluated nothing fails the test here, by name."""
    assert summary.metrics is not None, "the run evaluated no device"
    value = summary.metrics[name]
    assert value is not None, f"the run reported no {name}"
    return value


def metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir`/metrics.jsonl, one a round, in order."""
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
