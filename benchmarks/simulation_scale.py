"""Simulation at scale: speed-up from worker processes, and a 10,000-device run.

Each run is a fresh `pfl-coord simulate` process (so worker start-up, imports and the first
round's one-off costs are counted as a user pays them), timed by its own summary, with peak RSS
from the kernel (the parent and, separately, the largest worker). The worker counts of one
workload run back to back, alternating over the repeats; the table reports medians.

    python -m benchmarks.simulation_scale [--repeats 1] [--small-repeats 9] [--big-rounds 20]
        [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import core_balance
from benchmarks.common import publish_section
from device_agent.compute_threads import available_cores

MARKER = "<!-- simulation-scale -->"
SPEEDUP = {"task": "synthetic", "algorithm": "fedalt", "rounds": 5, "participation": 1.0}
BIG = {"task": "synthetic", "algorithm": "fedavg", "participation": 0.1, "devices": 10_000}


def _command(workload: dict[str, object], workers: int, out: str) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]
    command = [sys.executable, "-m", "coordinator.cli.app", "simulate", *flags]
    return [*command, f"--workers={workers}", f"--out={out}"]


def _summary(out: str) -> dict[str, Any]:
    return dict(json.loads((Path(out) / "summary.json").read_text()))


def simulate(workload: dict[str, object], workers: int) -> dict[str, float]:
    """One run in a fresh process: wall seconds (from its summary), peak RSS and the metric."""
    with tempfile.TemporaryDirectory() as out:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        subprocess.run(_command(workload, workers, out), check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        summary = _summary(out)
    return {
        "seconds": float(summary["wall_seconds"]),
        "metric": float(summary["metrics"]["personalized_mean"]),
        "peak_rss_mib": max(before, after) / 1024,  # the largest process of any run so far
    }


def two_at_once(workload: dict[str, object]) -> float:
    """Seconds of the slower of two one-worker runs started together.

    Nothing connects them, so this is what the machine itself gives two processes doing the
    work of one each: the ceiling a two-worker run (which also coordinates) is measured against.
    """
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        runs = [
            subprocess.Popen(_command(workload, 1, out), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for out in (first, second)
        ]  # fmt: skip
        if any(run.wait() != 0 for run in runs):
            msg = "a one-worker run of the pair failed"
            raise RuntimeError(msg)
        return max(float(_summary(out)["wall_seconds"]) for out in (first, second))


def idle_device_bytes(devices: int) -> float:
    """Memory one idle virtual device adds: RSS of a fleet built and joined, per device."""
    code = (
        "import resource, sys\n"
        "from coordinator.run.settings import SimulationSettings\n"
        "from coordinator.run.simulate import run_simulation\n"
        "n = int(sys.argv[1])\n"
        "run_simulation(SimulationSettings(task='synthetic', devices=n, rounds=1, workers=1,"
        " participation=1 / n, out=None))\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    peaks = [
        int(subprocess.run([sys.executable, "-c", code, str(n)], check=True,
                           capture_output=True, text=True).stdout.split()[-1])
        for n in (1, devices)
    ]  # fmt: skip
    return (peaks[1] - peaks[0]) * 1024 / (devices - 1)


def paired_range(base: list[float], times: list[float]) -> str:
    """The lowest and highest speed-up of runs made back to back ("1.52-1.96x").

    A run's speed swings with the host's load over seconds: the spread of back-to-back pairs
    shows how far one run's figure can stray from the median.
    """
    ratios = [one / other for one, other in zip(base, times, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def speedups(repeats: dict[int, int], worker_counts: list[int]) -> tuple[list[str], list[str]]:
    """Rows of the speed-up table, and of the machine's capacity for two processes.

    `repeats`: alternations per fleet size. Speed-ups: devices, workers, seconds, against one
    worker, the range over back-to-back runs, metric. Capacity: two one-worker runs at once
    against one alone, beside the two-worker speed-up.
    """
    rows, ceilings = [], []
    for devices, alternations in repeats.items():
        workload = {**SPEEDUP, "devices": devices}
        times: dict[int, list[float]] = {w: [] for w in worker_counts}
        pairs: list[float] = []
        metrics: dict[int, float] = {}
        for _ in range(alternations):
            for workers in worker_counts:
                run = simulate(workload, workers)
                times[workers].append(run["seconds"])
                metrics[workers] = run["metric"]
            pairs.append(two_at_once(workload))
        base = statistics.median(times[1])
        for workers in worker_counts:
            seconds = statistics.median(times[workers])
            rows.append(
                f"| {devices} | {workers} | {seconds:.1f} | **{base / seconds:.2f}x** | "
                f"{paired_range(times[1], times[workers])} | {metrics[workers]:.4f} |"
            )
        pair = statistics.median(pairs)
        capacity = 2 * base / pair
        two = base / statistics.median(times[2]) if 2 in times else float("nan")
        ceilings.append(
            f"| {devices} | {base:.1f} | {pair:.1f} | {capacity:.2f}x | {two:.2f}x | "
            f"{two / capacity:.0%} |"
        )
    return rows, ceilings


def main() -> None:
    """Run the measurements and write the section."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=1, help="alternations at 1000 devices")
    parser.add_argument(
        "--small-repeats", type=int, default=9, help="alternations at 100 devices (seconds each)"
    )
    parser.add_argument("--big-rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    cores = available_cores()
    worker_counts = sorted({1, 2, *([4] if cores >= 4 else []), cores})
    before = core_balance.cpu_jiffies()
    repeats = {100: max(args.small_repeats, args.repeats), 1000: args.repeats}
    rows, ceilings = speedups(repeats, worker_counts)
    stolen = core_balance.stolen_share(before, core_balance.cpu_jiffies())
    balance = core_balance.rows(30.0, (0.5, 5.0))
    print("\n".join(rows + ceilings + balance))
    big = simulate({**BIG, "rounds": args.big_rounds}, workers=cores)
    per_device = idle_device_bytes(2000)
    publish_section(
        args.out,
        MARKER,
        [
            "## Simulation on every core, and at 10,000 devices",
            "",
            f"Machine: {platform.machine()}, {cores} cores available, load average "
            f"{os.getloadavg()[0]:.1f} at the end. Each run is a fresh `pfl-coord simulate` "
            "process (imports, worker start-up and the final evaluation of every device "
            f"included); medians of {repeats[100]} (100 devices) and {repeats[1000]} (1000) "
            "alternating repeats, with the range of speed-ups over runs made back to back. "
            f"While they ran, the hypervisor took {stolen} of this virtual machine's CPU time "
            "(steal, /proc/stat).",
            "",
            "Speed-up: " + ", ".join(f"{k}={v}" for k, v in SPEEDUP.items()) + ".",
            "Results are bit-identical for every worker count (tests assert it). This model is "
            "small, so every process trains on one torch thread (device_agent/compute_threads.py).",
            "",
            "| devices | workers | seconds | speed-up | back-to-back range | personalized mean |",
            "|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "What the machine itself allows: two one-worker runs started together, nothing "
            "connecting them. Their slower one's time against one run alone is the capacity this "
            "machine has for two processes doing this work right now (2.00x on two idle, "
            "equal cores); a two-worker run also coordinates its devices, so it can only "
            "approach it.",
            "",
            "| devices | one run alone (s) | two at once (s) | capacity | 2 workers "
            "| of capacity |",
            "|---:|---:|---:|---:|---:|---:|",
            *ceilings,
            "",
            "One reason short rounds get less of the capacity: each worker owns a fixed half of "
            "the devices, so every round waits for the slower worker, and this machine's two "
            "cores do not run at one speed. Both cores running the same training step, each in a "
            "pinned process, counted per quarter second (`python -m benchmarks.core_balance`); "
            "replaying rounds split evenly between them at those speeds gives the share of the "
            "two cores' throughput such a round gets. A 100-device round with 2 workers lasts "
            "about 0.5 s, a 1000-device one about 5 s: short rounds meet every swing in speed, "
            "long ones average them out. The rest of the gap at 100 devices is the "
            "coordinator's work in every round (relaying and checking each update, in the "
            "parent process), a larger share of a short round.",
            "",
            "| measured | samples | result |",
            "|---|---:|---|",
            *balance,
            "",
            "Ten thousand devices: "
            + ", ".join(f"{k}={v}" for k, v in BIG.items())
            + f", rounds={args.big_rounds}, {cores} workers.",
            "",
            "| wall seconds | largest process peak RSS (MiB) | memory per idle device | "
            "personalized mean |",
            "|---:|---:|---:|---:|",
            f"| {big['seconds']:.1f} | {big['peak_rss_mib']:.0f} | {per_device / 1024:.1f} KiB "
            f"| {big['metric']:.4f} |",
            "",
            "Memory per idle device: peak RSS of a 2,000-device simulation minus a 1-device "
            "one, per device (its data, agent, personal state and subscriptions). The metric is "
            "FedAvg's one global model on synthetic(1,1), where every device has its own "
            "labelling function: with 10,000 of them one model is near chance (0.35 at 100 "
            "devices); this run measures scale, the personalized algorithms measure accuracy.",
            "",
            "Command: `python -m benchmarks.simulation_scale`. Target: >= 1.8x on 2 cores.",
        ],
    )


if __name__ == "__main__":
    main()
