"""`--batched auto` against `off`, algorithm by algorithm, on a workload where auto batches.

The batched overhead table (`benchmarks.batched_overhead`) times FedAvg; every family that
batches has its own stacked step (momentum, proximal terms, personal parameters, Ditto's two
models, pFedMe's and pFedBreD's own rounds), so each is timed here against its per-device run:
the digits MLP (47k multiply-adds a step, under `AUTO_MAX_STEP_MACS`), 50 devices, 5 rounds,
one worker, in-run, each algorithm at its defaults (FedAlt and FedSim with the output layer
personal). Modes alternate; medians of the repeats, after one warm-up run of each.

    OMP_NUM_THREADS=1 nice python -m benchmarks.batched_algorithms [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any, Final

from benchmarks.batched_overhead import in_run, machine, step_macs
from benchmarks.common import write_section
from benchmarks.simulation_overhead import WORKLOAD
from coordinator.run.settings import SimulationSettings

MARKER: Final = "<!-- batched-algorithms -->"
ALGORITHMS: Final = (
    "fedavg", "fedavg-ft", "fedprox", "fedalt", "fedsim", "ditto", "local", "pfedme", "pfedbred",
)  # fmt: skip
PERSONAL_OUTPUT: Final = ("fedalt", "fedsim")


def workload(algorithm: str) -> SimulationSettings:
    """The digits MLP run of `algorithm`: 50 devices, 5 rounds."""
    values: dict[str, Any] = {**WORKLOAD, "algorithm": algorithm, "rounds": 5}
    if algorithm in PERSONAL_OUTPUT:
        values["personal_preset"] = "output"
    return SimulationSettings.load(None, **values)


def table(repeats: int) -> str:
    """One row per algorithm: off and auto in-run seconds, the speed-up, both accuracies."""
    load = os.getloadavg()[0]
    rows = []
    for algorithm in ALGORITHMS:
        chosen = workload(algorithm)
        modes = ("off", "auto")
        for mode in modes:  # warm-up
            in_run(mode, chosen)
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        accuracy: dict[str, float] = {}
        for _ in range(repeats):
            for mode in modes:
                took, accuracy[mode] = in_run(mode, chosen)
                seconds[mode].append(took)
        off, auto = (statistics.median(seconds[mode]) for mode in modes)
        rows.append(
            f"| {algorithm} | {off:.2f} | {auto:.2f} | {off / auto:.2f}x | "
            f"{accuracy['off']:.4f} | {accuracy['auto']:.4f} |"
        )
        print(rows[-1], flush=True)
    macs = step_macs(workload("fedavg"))
    return "\n".join(
        [
            MARKER,
            "### Batched against per-device, algorithm by algorithm",
            "",
            f"The digits MLP ({macs:,} multiply-adds a step: `auto` batches it), dirichlet "
            "alpha=0.5, 50 devices, 5 rounds, seed 0, one worker, in-run; each algorithm at its "
            "defaults (FedAlt and FedSim with the output layer personal).",
            machine(repeats, load),
            "",
            "| algorithm | --batched off (s) | --batched auto (s) | speed-up of auto | "
            "accuracy off | accuracy auto |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Command: `OMP_NUM_THREADS=1 nice python -m benchmarks.batched_algorithms "
            f"--repeats {repeats}`.",
            MARKER,
        ]
    )


def main() -> None:
    """Measure and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    write_section(args.out, table(args.repeats), MARKER)


if __name__ == "__main__":
    main()
