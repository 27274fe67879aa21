"""Secure aggregation's cost: bytes and seconds per round against plain aggregation.

Side by side in one run, for 10, 100 and 500 devices (all selected every round, synthetic task,
FedAvg, one local epoch): plain updates; SecAgg with every device masking with every other
(`--secagg`); and SecAgg+ with 40 neighbours (`--secagg-neighbors 40`) where the cohort is large.
Seconds are the rounds' mean wall time (the first round, which warms up, is left out); bytes are
per round, up (devices to broker) and down (broker to devices). Writes docs/benchmarks.md.

    OMP_NUM_THREADS=1 python -m benchmarks.secagg_cost [--rounds 3] [--devices 10,100,500]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any, Final

from benchmarks.common import write_table_section
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- secagg-cost -->"
SPARSE: Final = 40


def measure(devices: int, rounds: int, **options: Any) -> dict[str, float]:
    """Mean seconds (after the first round) and bytes per round of one configuration."""
    with tempfile.TemporaryDirectory() as out:
        settings = SimulationSettings.load(
            None, task="synthetic", devices=devices, rounds=rounds, local_epochs=1, out=out,
            **options,
        )  # fmt: skip
        records = run_simulation(settings).records
    timed = records[1:] or records
    return {
        "seconds": statistics.fmean(r.wall_seconds for r in timed),
        "up": statistics.fmean(r.bytes_up for r in records),
        "down": statistics.fmean(r.bytes_down for r in records),
    }


def main() -> None:
    """Measure every configuration and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", default="10,100,500")
    args = parser.parse_args()
    rows = []
    for devices in (int(d) for d in args.devices.split(",")):
        plain = measure(devices, args.rounds)
        variants: list[tuple[str, dict[str, object]]] = [("SecAgg (all pairs)", {"secagg": True})]
        if devices > SPARSE + 1:
            sparse: dict[str, object] = {"secagg": True, "secagg_neighbors": SPARSE}
            variants.append((f"SecAgg+ ({SPARSE} neighbours)", sparse))
        up, down = f"{plain['up'] / 1e6:.2f}", f"{plain['down'] / 1e6:.2f}"
        seconds = f"{plain['seconds']:.3f}"
        rows.append([str(devices), "plain", seconds, "1.00x", up, "1.00x", down, "1.00x"])
        for name, options in variants:
            cost = measure(devices, args.rounds, **options)
            rows.append([
                str(devices), name, f"{cost['seconds']:.3f}",
                f"{cost['seconds'] / plain['seconds']:.2f}x", f"{cost['up'] / 1e6:.2f}",
                f"{cost['up'] / plain['up']:.2f}x", f"{cost['down'] / 1e6:.2f}",
                f"{cost['down'] / plain['down']:.2f}x",
            ])  # fmt: skip
            print(rows[-1], flush=True)
    header = ["devices", "aggregation", "s / round", "time", "MB up / round", "up",
              "MB down / round", "down"]  # fmt: skip
    command = "OMP_NUM_THREADS=1 python -m benchmarks.secagg_cost"
    footer = f"{args.rounds} rounds each, first round's time left out; `{command}`."
    write_table_section(REPO / "docs/benchmarks.md", MARKER, header, rows, footer)


if __name__ == "__main__":
    main()
