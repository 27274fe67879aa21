"""Re-run cells of the results matrix afresh and say which cached figures reproduce today.

The matrix (benchmarks/results_matrix.py) reuses every cached cell whose request and guard
bounds still match, so its tables can outlive a change of code or of a default the request does
not name. This runs the selected cells again into a scratch cache, at today's code and
defaults, and compares each with the cached cell of the same (workload, algorithm, seed):
personalized mean, global model and worst 10%, exact or not. The tables (how many cells of each
workload reproduce, then every cell that moved) go between the `<!-- matrix-recheck -->`
markers of docs/results.md (with `--batched MODE`, between `<!-- matrix-recheck-batched-MODE -->`).

    OMP_NUM_THREADS=1 python -m benchmarks.matrix_recheck --workloads digits-many,synthetic-many
        --seeds 0,1,2 --scratch /tmp/matrix-recheck [--algorithms fedavg,ditto] [--batched off]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, get_args

from benchmarks.common import choose, markdown_table, publish_section
from benchmarks.results_matrix import (
    REPO,
    WORKLOADS,
    Workload,
    cell_path,
    compute,
    matrix_algorithms,
    not_applicable,
)
from coordinator.run.compare import parse_seeds
from device_agent.batched.choice import BatchedMode

MARKER: Final = "<!-- matrix-recheck -->"
VALUES: Final = (("personalized_mean", "personalized mean"), ("global", "global"))
WORST: Final = "personalized_worst10"
ROUNDING: Final = 1e-5
"""A change up to this is float rounding (four decimals do not show it)."""


def _metrics(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    metrics: dict[str, Any] = json.loads(path.read_text())["summary"]["metrics"]
    return metrics


def _pair(fresh: float | None, cached: float | None) -> str:
    def show(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    return f"{show(fresh)} / {show(cached)}"


def _largest_change(fresh: dict[str, Any], cached: dict[str, Any], keys: Sequence[str]) -> float:
    """The largest absolute difference of the values both hold (a value only one holds: inf)."""
    changes = [
        0.0 if fresh.get(key) == cached.get(key) else
        abs(fresh[key] - cached[key]) if None not in (fresh.get(key), cached.get(key)) else
        float("inf")
        for key in keys
    ]  # fmt: skip
    return max(changes, default=0.0)


@dataclass(frozen=True)
class Recheck:
    """One re-run cell against its cached twin."""

    workload: str
    algorithm: str
    seed: int
    values: tuple[str, ...]
    """Each of VALUES and WORST as "today / cached" (blank: no cached cell)."""
    change: float
    """The largest absolute difference of the three (0.0: exact; inf: no cached cell)."""

    @property
    def exact(self) -> bool:
        """The cell reproduces its cached values to the bit."""
        return self.change == 0.0

    @property
    def rounding(self) -> bool:
        """The cell differs from its cached values, by float rounding at most (ROUNDING)."""
        return 0.0 < self.change <= ROUNDING

    @property
    def moved(self) -> bool:
        """The cell differs from its cached values by more than rounding."""
        return self.change > ROUNDING


def compare_rows(
    workloads: Sequence[Workload],
    algorithms: Sequence[str],
    seeds: Sequence[int],
    fresh_dir: Path,
    cache_dir: Path,
) -> list[Recheck]:
    """One row per re-run cell: each value fresh / cached, and the largest change."""
    keys = [key for key, _ in VALUES] + [WORST]
    rows = []
    for workload in workloads:
        for algorithm in algorithms:
            if not_applicable(workload, algorithm) is not None:
                continue
            for seed in seeds:
                fresh = _metrics(cell_path(fresh_dir, workload, algorithm, seed))
                cached = _metrics(cell_path(cache_dir, workload, algorithm, seed))
                if fresh is None:
                    continue
                if cached is None:
                    blank = ("",) * len(keys)
                    rows.append(Recheck(workload.key, algorithm, seed, blank, float("inf")))
                    continue
                values = tuple(_pair(fresh.get(key), cached.get(key)) for key in keys)
                change = _largest_change(fresh, cached, keys)
                rows.append(Recheck(workload.key, algorithm, seed, values, change))
    return rows


def _show_change(change: float) -> str:
    return "no cached cell" if change == float("inf") else f"{change:.2g}"


def section_lines(rows: Sequence[Recheck], command: str) -> list[str]:
    """The markdown section: per workload how many cells reproduce, then every cell that moved."""
    summary = []
    for workload in dict.fromkeys(row.workload for row in rows):
        own = [row for row in rows if row.workload == workload]
        moved = [row.change for row in own if row.moved]
        summary.append(
            [
                workload,
                str(len(own)),
                str(sum(row.exact for row in own)),
                str(sum(row.rounding for row in own)),
                str(len(moved)),
                _show_change(max(moved)) if moved else "",
            ]
        )
    header = ["workload", "algorithm", "seed", "personalized mean (today / cached)"]
    header += ["global (today / cached)", "worst 10% (today / cached)", "largest change"]
    detail = [
        [row.workload, row.algorithm, str(row.seed), *row.values, _show_change(row.change)]
        for row in rows
        if row.moved
    ]
    exact = sum(row.exact for row in rows)
    close = sum(row.rounding for row in rows)
    lines = markdown_table(
        ["workload", "cells", "exact", f"within {ROUNDING:g}", "moved", "largest move"], summary
    )
    if detail:
        lines += ["", f"Cells that moved by more than {ROUNDING:g}:", ""]
        lines += markdown_table(header, detail)
    return [
        *lines,
        "",
        f"{exact} of {len(rows)} re-run cells give the cached values exactly, {close} more "
        f"within {ROUNDING:g}. Run on {datetime.date.today().isoformat()}: `{command}`",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Re-run the selected cells into the scratch cache, then publish the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", help="comma-separated <task>-<setting> (default: all)")
    parser.add_argument("--algorithms", help="comma-separated (default: every algorithm)")
    parser.add_argument("--seeds", default="1", help="a count N (0..N-1) or a list like 0,1,2")
    parser.add_argument("--scratch", type=Path, required=True, help="cache of the fresh runs")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument(
        "--batched",
        choices=get_args(BatchedMode),
        help="simulate's --batched for the fresh runs (default: simulate's own default)",
    )
    args = parser.parse_args(argv)
    if args.scratch.resolve() == args.cache_dir.resolve():
        parser.error("--scratch must not be the cache it is compared with")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("coordinator", "device_agent", "protocols"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    by_key = {w.key: w for w in WORKLOADS}
    workloads = [by_key[key] for key in choose(args.workloads, list(by_key), "workload")]
    if args.batched is not None:
        workloads = [
            dataclasses.replace(w, simulate={**w.simulate, "batched": args.batched})
            for w in workloads
        ]
    algorithms = choose(args.algorithms, matrix_algorithms(), "algorithm")
    seeds = parse_seeds(args.seeds)
    compute(workloads, algorithms, seeds, args.scratch)
    rows = compare_rows(workloads, algorithms, seeds, args.scratch, args.cache_dir)
    command = "OMP_NUM_THREADS=1 python -m benchmarks.matrix_recheck " + " ".join(
        f"--{name} {value}"
        for name, value in (
            ("workloads", args.workloads),
            ("algorithms", args.algorithms),
            ("seeds", args.seeds),
            ("batched", args.batched),
            ("scratch", args.scratch),
        )
        if value is not None
    )
    marker = MARKER if args.batched is None else f"<!-- matrix-recheck-batched-{args.batched} -->"
    publish_section(args.out, marker, section_lines(rows, command))


if __name__ == "__main__":
    main()
