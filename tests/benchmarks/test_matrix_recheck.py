"""The matrix recheck: cells re-run into a scratch cache, compared value by value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import matrix_recheck
from benchmarks.results_matrix import cell_path, compute
from tests.benchmarks.test_results_matrix import ALGORITHMS, TINY

pytestmark = pytest.mark.slow


def test_a_fresh_run_matches_its_cache_and_a_changed_cell_is_named(tmp_path: Path) -> None:
    # Prepare: the "cached" matrix, then the same cells again into a scratch cache
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    compute([TINY], ALGORITHMS, [0], cache)
    compute([TINY], ALGORITHMS, [0], scratch)
    fedavg = cell_path(cache, TINY, "fedavg", 0)
    document = json.loads(fedavg.read_text())
    fresh_mean = document["summary"]["metrics"]["personalized_mean"]
    document["summary"]["metrics"]["personalized_mean"] = fresh_mean - 0.01
    fedavg.write_text(json.dumps(document))

    # Execute
    rows = matrix_recheck.compare_rows([TINY], ALGORITHMS, [0], scratch, cache)
    lines = matrix_recheck.section_lines(rows, "the command")

    # Assert: local is exact (the same code and seed give the same run), fedavg is named
    assert [(row.algorithm, row.exact) for row in rows] == [("local", True), ("fedavg", False)]
    assert rows[0].values[1] == "n/a / n/a"  # local has no global model
    assert rows[1].values[0] == f"{fresh_mean:.4f} / {fresh_mean - 0.01:.4f}"
    assert rows[1].change == pytest.approx(0.01)
    # the summary counts one exact and one moved cell; the detail lists fedavg alone
    assert f"| {TINY.key} | 2 | 1 | 0 | 1 | 0.01 |" in lines
    assert [line for line in lines if line.startswith(f"| {TINY.key} | ")][1:] == [
        f"| {TINY.key} | fedavg | 0 | {rows[1].values[0]} | {rows[1].values[1]} | "
        f"{rows[1].values[2]} | 0.01 |"
    ]
    assert lines[-1].startswith(
        "1 of 2 re-run cells give the cached values exactly, 0 more within 1e-05. Run on "
    )
    assert lines[-1].endswith(": `the command`")


def test_the_scratch_cache_must_not_be_the_compared_cache(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        matrix_recheck.main(["--scratch", str(tmp_path), "--cache-dir", str(tmp_path)])
