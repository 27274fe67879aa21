"""Personalization on MNIST-1D under label skew and under feature shift, for docs/results.md.

Two workloads of the `mnist1d` task with its 1-D CNN (GroupNorm), 10 devices, all taking part
every round:

* label skew:    the "shards" partition, 2 labels per device, no sensor shift;
* feature shift: the "iid" partition (every device holds every class) with `shift="feature"`:
                 each device records through its own gain, offset, noise and time warp.

Rows: Local, FedAvg, FedAvg-FT, FedAlt and FedSim with the output layer personal, FedAlt with
the input convolution and every GroupNorm personal (the FedBN idea with the norms this model
has), Ditto, and on the same CNN with BatchNorm (`--model cnn-bn`): FedBN (FedAvg with every
BatchNorm layer, affine weights and running statistics, personal: the `fedbn` preset) and plain
FedAvg, which averages the BatchNorm layers too. FedAlt/FedSim spend the first half of the
rounds on FedAvg pretraining, as in benchmarks/results_matrix.py. Each finished cell
(workload, row, seed) is cached as JSON under benchmarks/results/mnist1d/, so a rerun computes
only missing cells, and several invocations with different `--seeds` or `--rows` can run side
by side; `--from-cache` only rewrites the doc section.

    OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.mnist1d_results [--seeds 0,1,2]
        [--workloads label-skew,feature-shift] [--rows fedavg,ditto] [--from-cache]
        [--out docs/results.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.common import choose, mean_std_cell, one_thread, publish_section
from coordinator.run.compare import plan_runs, run_values
from coordinator.run.simulate import run_simulation

logger = logging.getLogger(__name__)

REPO: Final = Path(__file__).resolve().parents[1]
CACHE: Final = REPO / "benchmarks" / "results" / "mnist1d"
MARKER: Final = "<!-- mnist1d-results -->"
COMMON: Final[dict[str, Any]] = {
    "task": "mnist1d",
    "devices": 10,
    "rounds": 20,
    "local_epochs": 1,
    "batch_size": 10,
    "lr": 0.1,
    "workers": 1,
}
WORKLOADS: Final[dict[str, dict[str, Any]]] = {
    "label-skew": {"partition": "shards", "labels_per_device": 2},
    "feature-shift": {"partition": "iid", "task_options": {"shift": "feature"}},
}
INPUT_AND_NORMS: Final = ["input.*", "norm*"]
BN_CNN: Final[dict[str, Any]] = {"model": "cnn-bn"}
FEDBN: Final[dict[str, Any]] = {"personal_preset": "fedbn"}


@dataclass(frozen=True)
class Row:
    """One table row: an algorithm and its settings (personal part, model)."""

    key: str
    label: str
    algorithm: str
    options: dict[str, Any]
    pretrain: bool = False


ROWS: Final = (
    Row("local", "Local", "local", {}),
    Row("fedavg", "FedAvg", "fedavg", {}),
    Row("fedavg-ft", "FedAvg-FT", "fedavg-ft", {}),
    Row("fedalt", "FedAlt (output personal)", "fedalt", {"personal_preset": "output"}, True),
    Row("fedsim", "FedSim (output personal)", "fedsim", {"personal_preset": "output"}, True),
    Row(
        "fedalt-input",
        "FedAlt (input conv + norms personal)",
        "fedalt",
        {"personal": INPUT_AND_NORMS},
        True,
    ),
    Row("ditto", "Ditto", "ditto", {}),
    Row("fedbn", "FedBN (BatchNorm CNN, norms personal)", "fedavg", {**BN_CNN, **FEDBN}),
    Row("fedavg-bn", "FedAvg (BatchNorm CNN)", "fedavg", BN_CNN),
)
COLUMNS: Final = (
    ("personalized_mean", "personalized mean"),
    ("personalized_worst10", "worst 10%"),
    ("global", "global model"),
)


def request(workload: str, row: Row, seed: int) -> dict[str, Any]:
    """Simulate's settings of one cell (pretraining takes half the rounds where the row says)."""
    values: dict[str, Any] = {**COMMON, **WORKLOADS[workload], **row.options}
    if row.pretrain:
        half = values["rounds"] // 2
        values.update(rounds=values["rounds"] - half, pretrain_rounds=half)
    return {**values, "algorithm": row.algorithm, "seed": seed}


def cell_path(workload: str, row: Row, seed: int) -> Path:
    """Where one cell is cached."""
    return CACHE / workload / row.key / f"seed-{seed}.json"


def cached(workload: str, row: Row, seed: int) -> dict[str, float | None] | None:
    """A cell's values if it was run with today's request, else None."""
    path = cell_path(workload, row, seed)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("request") != json.loads(json.dumps(request(workload, row, seed))):
        return None
    values: dict[str, float | None] = data["values"]
    return values


def run_cell(workload: str, row: Row, seed: int) -> dict[str, float | None]:
    """Simulate one cell and cache its values."""
    wanted = request(workload, row, seed)
    overrides = {k: v for k, v in wanted.items() if k not in ("algorithm", "seed")}
    (spec,) = plan_runs([row.algorithm], [seed], Path("."), overrides=overrides)
    settings = spec.settings.model_copy(update={"out": None})
    values = run_values(run_simulation(settings).summary)
    path = cell_path(workload, row, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"request": wanted, "values": values}, indent=1) + "\n")
    return values


def table(workload: str, rows: list[Row], seeds: list[int]) -> list[str]:
    """One workload's markdown table from the cache: accuracy in %, mean ± std over seeds."""
    header = ["method", *(title for _, title in COLUMNS), "seeds"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        cells = [cached(workload, row, seed) for seed in seeds]
        present = [cell for cell in cells if cell is not None]
        values = [
            mean_std_cell([cell[key] for cell in present], scale=100.0, digits=1)
            for key, _ in COLUMNS
        ]
        lines.append(f"| {row.label} | " + " | ".join(values) + f" | {len(present)} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run the missing cells, then publish both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workloads", default=None)
    parser.add_argument("--rows", default=None)
    parser.add_argument("--from-cache", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    args = parser.parse_args(argv)
    one_thread()
    logging.disable(logging.WARNING)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    workloads = choose(args.workloads, list(WORKLOADS), "workloads")
    by_key = {row.key: row for row in ROWS}
    rows = [by_key[key] for key in choose(args.rows, list(by_key), "rows")]
    for seed in seeds:  # seed-major: an interrupted run still fills every row
        for workload in workloads:
            for row in rows:
                if args.from_cache or cached(workload, row, seed) is not None:
                    continue
                started = time.perf_counter()
                values = run_cell(workload, row, seed)
                seconds = time.perf_counter() - started
                print(f"{workload} {row.key} seed {seed}: {values['personalized_mean']} "
                      f"({seconds:.0f} s)", flush=True)  # fmt: skip
    lines: list[str] = []
    for workload in workloads:
        lines += [f"**{workload}** ({json.dumps(WORKLOADS[workload])})", ""]
        lines += [*table(workload, rows, seeds), ""]
    lines.append(
        f"Common settings: {json.dumps(COMMON)}; accuracy in % on each device's own test split. "
        f"Command: `OMP_NUM_THREADS=1 python -m benchmarks.mnist1d_results --seeds {args.seeds} "
        f"--rows {','.join(row.key for row in rows)}`"
    )
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
