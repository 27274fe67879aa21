"""benchmarks/results_matrix.py on a tiny workload: cached cells, the doc table, cache reuse."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import results_matrix
from benchmarks.results_matrix import Output, Workload, cell_path, run_matrix
from coordinator.run.settings import SimulationSettings
from coordinator.stages.aggregate_guard import GuardSettings

pytestmark = pytest.mark.slow

TINY = Workload(
    "digits",
    "few",
    "3 devices",
    {"devices": 3, "rounds": 2, "partition": "iid", "local_epochs": 1, "lr": 0.1,
     "batch_size": 10},
)  # fmt: skip
ALGORITHMS = ("local", "fedavg")


def _run(tmp_path: Path, **kwargs: bool) -> results_matrix.MatrixRun:
    output = Output(tmp_path / "results.md", tmp_path / "img", [TINY], ALGORITHMS)
    return run_matrix([TINY], ALGORITHMS, [0], tmp_path / "cache", output, **kwargs)


def test_matrix_caches_cells_writes_the_table_and_reuses_the_cache(tmp_path, monkeypatch) -> None:
    # Prepare: a doc with content the matrix must keep
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nearlier section\n")
    # Execute
    first = _run(tmp_path)
    # Assert: one cache file per cell, holding the summary and per-round records
    assert (first.computed, first.reused) == (2, 0)
    for algorithm in ALGORITHMS:
        path = cell_path(tmp_path / "cache", TINY, algorithm, 0)
        cached = json.loads(path.read_text())
        assert cached["summary"]["algorithm"] == algorithm
        assert cached["summary"]["devices"] == 3
        assert cached["rounds"]
    # Assert: the doc keeps its content and gains the table between the markers
    text = doc.read_text()
    assert "earlier section" in text
    assert text.count(results_matrix.MARKER) == 2
    assert "### digits, few: 3 devices" in text
    rows = [line for line in text.splitlines() if line.startswith(("| local |", "| fedavg |"))]
    assert len(rows) == 2
    assert all("| 1 |" in row for row in rows)
    assert (tmp_path / "img" / "results-digits-few-accuracy.png").is_file()

    # Execute: a second run must not simulate anything
    def no_simulation(*args: object, **kwargs: object) -> None:
        msg = "a cached cell was recomputed"
        raise AssertionError(msg)

    monkeypatch.setattr(results_matrix, "run_comparison", no_simulation)
    second = _run(tmp_path)
    from_cache = _run(tmp_path, from_cache=True)
    # Assert
    assert (second.computed, second.reused) == (0, 2)
    assert from_cache.computed == 0
    assert doc.read_text() == text


def test_changed_settings_invalidate_a_cached_cell(tmp_path) -> None:
    # Prepare: a cached cell run with other settings
    _run(tmp_path)
    path = cell_path(tmp_path / "cache", TINY, "local", 0)
    cached = json.loads(path.read_text())
    cached["request"]["rounds"] = 99
    path.write_text(json.dumps(cached))
    # Execute
    rerun = _run(tmp_path)
    # Assert: only the stale cell ran again
    assert (rerun.computed, rerun.reused) == (1, 1)


def test_a_changed_guard_default_marks_then_recomputes_every_cached_cell(
    tmp_path, monkeypatch
) -> None:
    # Prepare: cells cached under today's guard, then a guard default changes (the request,
    # which holds only what the matrix asks for, stays the same)
    _run(tmp_path)
    today = SimulationSettings.guard_settings

    def old_norm_bound(settings: SimulationSettings) -> GuardSettings:
        return replace(today(settings), norm_bound=10.0)

    monkeypatch.setattr(SimulationSettings, "guard_settings", old_norm_bound)
    # Execute: the doc from the cache, then a rerun
    _run(tmp_path, from_cache=True)
    marked = (tmp_path / "results.md").read_text()
    rerun = _run(tmp_path)
    # Assert: the stale rows keep their figures but say so; the rerun reuses none of them, and
    # the new cells record their bounds
    assert f"- local, fedavg: {results_matrix.STALE}" in marked
    assert "| fedavg | 1 | 0." in marked
    assert (rerun.computed, rerun.reused) == (2, 0)
    assert results_matrix.STALE not in (tmp_path / "results.md").read_text()
    cached = json.loads(cell_path(tmp_path / "cache", TINY, "fedavg", 0).read_text())
    assert cached["guard"]["norm_bound"] == 10.0


def test_partial_methods_are_not_applicable_without_a_shared_part() -> None:
    # Prepare: sine's model is one linear layer, its output layer
    sine = next(w for w in results_matrix.WORKLOADS if w.task == "sine")
    digits = next(w for w in results_matrix.WORKLOADS if w.task == "digits")
    # Execute / Assert
    assert "nothing is left to share" in (results_matrix.not_applicable(sine, "fedalt") or "")
    assert results_matrix.not_applicable(digits, "fedalt") is None
