"""Re-run cells of the results matrix afresh and say which cached figures reproduce today.

The matrix (benchmarks/results_matrix.py) reuses every cached cell whose request and guard
bounds still match, so its tables can outlive a change of code or of a default the request does
not name. This runs the selected cells again into a scratch cache, at today's code and
defaults, and compares each with the cached cell of the same (workload, algorithm, seed):
personalized mean, global model and worst 10%, exact or not. The table goes between the
`<!-- matrix-recheck -->` markers of docs/results.md.

    OMP_NUM_THREADS=1 python -m benchmarks.matrix_recheck --workloads digits-many,synthetic-many
        --seeds 1 --scratch /tmp/matrix-recheck [--algorithms fedavg,ditto]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks.common import choose, publish_section
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

MARKER: Final = "<!-- matrix-recheck -->"
VALUES: Final = (("personalized_mean", "personalized mean"), ("global", "global"))
WORST: Final = "personalized_worst10"


def _metrics(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    metrics: dict[str, Any] = json.loads(path.read_text())["summary"]["metrics"]
    return metrics


def _pair(fresh: float | None, cached: float | None) -> str:
    def show(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    return f"{show(fresh)} / {show(cached)}"


def compare_rows(
    workloads: Sequence[Workload],
    algorithms: Sequence[str],
    seeds: Sequence[int],
    fresh_dir: Path,
    cache_dir: Path,
) -> list[list[str]]:
    """One row per re-run cell: each value fresh / cached, and whether all three are exact."""
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
                    rows.append([workload.key, algorithm, str(seed), "no cached cell", "", ""])
                    continue
                keys = [key for key, _ in VALUES] + [WORST]
                same = all(fresh.get(key) == cached.get(key) for key in keys)
                rows.append(
                    [
                        workload.key,
                        algorithm,
                        str(seed),
                        *(_pair(fresh.get(key), cached.get(key)) for key in keys),
                        "yes" if same else "no",
                    ]
                )
    return rows


def section_lines(rows: Sequence[Sequence[str]], command: str) -> list[str]:
    """The markdown section: the table, how many cells are exact, the command and date."""
    header = ["workload", "algorithm", "seed", "personalized mean (today / cached)"]
    header += ["global (today / cached)", "worst 10% (today / cached)", "exact"]
    exact = sum(row[-1] == "yes" for row in rows)
    return [
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"{exact} of {len(rows)} re-run cells give the cached values exactly. Run on "
        f"{datetime.date.today().isoformat()}: `{command}`",
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
    args = parser.parse_args(argv)
    if args.scratch.resolve() == args.cache_dir.resolve():
        parser.error("--scratch must not be the cache it is compared with")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("coordinator", "device_agent", "protocols"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    by_key = {w.key: w for w in WORKLOADS}
    workloads = [by_key[key] for key in choose(args.workloads, list(by_key), "workload")]
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
            ("scratch", args.scratch),
        )
        if value is not None
    )
    publish_section(args.out, MARKER, section_lines(rows, command))


if __name__ == "__main__":
    main()
