"""Simulation overhead on a convolutional workload: the MNIST-1D CNN against a bare PyTorch loop.

benchmarks/simulation_overhead.py measures it on the digits MLP, where a training step is so
cheap that the framework's own work shows most. This runs the same comparison (its bare FedAvg
loop and its one-worker simulation) on the mnist1d task's 17k-parameter 1-D CNN with GroupNorm,
where a step costs what a small edge model costs. Both alternate in one process after one
warm-up of each; medians are reported.

    OMP_NUM_THREADS=1 python -m benchmarks.mnist1d_overhead [--repeats 3] [--rounds 3]
        [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path
from typing import Any, Final

import torch

from benchmarks.common import publish_section
from benchmarks.simulation_overhead import bare_loop, simulated
from coordinator.run.settings import SimulationSettings

WORKLOAD: Final[dict[str, Any]] = {
    "task": "mnist1d",
    "algorithm": "fedavg",
    "devices": 10,
    "local_epochs": 1,
    "partition": "iid",
    "seed": 0,
}
REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- mnist1d-overhead -->"


def measure(settings: SimulationSettings, repeats: int) -> dict[str, float]:
    """Median seconds of the bare loop and of the simulation, alternating after a warm-up."""
    bare_loop(settings)  # warm-up: generating the data set, imports, allocator
    simulated(settings)
    bare_times, sim_times = [], []
    for _ in range(repeats):
        bare_seconds, bare_accuracy = bare_loop(settings)
        sim_seconds, sim_accuracy, moved = simulated(settings)
        bare_times.append(bare_seconds)
        sim_times.append(sim_seconds)
    bare, sim = statistics.median(bare_times), statistics.median(sim_times)
    return {
        "bare": bare,
        "sim": sim,
        "ratio": sim / bare,
        "bare_accuracy": bare_accuracy,
        "sim_accuracy": sim_accuracy,
        "moved": moved,
    }


def main(argv: list[str] | None = None) -> None:
    """Measure and publish the CNN row."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    settings = SimulationSettings.load(None, **WORKLOAD, rounds=args.rounds)
    run = measure(settings, args.repeats)
    config = settings.algorithm_config()
    lines = [
        "## Simulation overhead on the MNIST-1D CNN",
        "",
        "Workload: "
        + ", ".join(f"{k}={v}" for k, v in {**WORKLOAD, "rounds": args.rounds}.items())
        + f"; the 1-D CNN (16,906 parameters, GroupNorm); batch size {config.batch_size}, "
        f"lr {config.lr}. Machine: {platform.machine()}, torch {torch.__version__}, one worker, "
        f"median of {args.repeats} alternating repeats after a warm-up of each.",
        "",
        "| bare loop (s) | simulate, 1 worker (s) | ratio | bare accuracy | simulate accuracy "
        "| payload bytes moved |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {run['bare']:.2f} | {run['sim']:.2f} | **{run['ratio']:.2f}x** | "
        f"{run['bare_accuracy']:.3f} | {run['sim_accuracy']:.3f} | {run['moved']:,} |",
        "",
        f"Command: `OMP_NUM_THREADS=1 python -m benchmarks.mnist1d_overhead --repeats "
        f"{args.repeats} --rounds {args.rounds}`.",
    ]
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
