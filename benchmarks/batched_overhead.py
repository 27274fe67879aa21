"""Batched against per-device simulation and a bare PyTorch loop: in-run and whole-process time.

The workload of `benchmarks.simulation_overhead` (digits MLP, FedAvg, 50 devices, 20 rounds, one
worker so the devices train in one process): `pfl-coord simulate --batched on` (the round's
local updates as one stacked computation), `--batched off` (each device in turn, as the bare
loop does) and the bare loop. In-run: the run alone, in a warm process. Whole process: a fresh
`python` doing the same from its first import. Runs alternate; medians of the repeats.

    OMP_NUM_THREADS=1 nice python -m benchmarks.batched_overhead [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_section
from benchmarks.simulation_overhead import WORKLOAD, bare_loop, mean_test_metric, simulated_fleet
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from device_agent.algorithms.base import BatchPhase
from device_agent.batched.stacked import Member, train_stacked
from device_agent.compute_threads import available_cores
from device_agent.training import TrainSpec
from pfl_tasks.registry import load_task

MARKER = "<!-- batched-overhead -->"
MODES = ("bare", "stacked", "off", "on")


def in_run(mode: str, settings: SimulationSettings) -> tuple[float, float]:
    """(seconds, mean accuracy) of one run of `mode` in this (warm) process."""
    if mode == "bare":
        return bare_loop(settings)
    if mode == "stacked":
        return stacked_loop(settings)
    started = time.perf_counter()
    result = run_simulation(settings.model_copy(update={"workers": 1, "batched": mode}))
    return time.perf_counter() - started, float(result.summary["metrics"]["personalized_mean"])


def stacked_loop(workload: SimulationSettings) -> tuple[float, float]:
    """The bare loop's FedAvg with each round's local SGD as one stacked computation.

    What batching can gain with no framework around it: (seconds, mean test accuracy).
    """
    task = load_task(workload.task)
    config = workload.algorithm_config()
    fleet = simulated_fleet(workload, task)
    started = time.perf_counter()
    model = task.build_model(workload.seed)
    names = tuple(name for name, _ in model.named_parameters())
    spec = TrainSpec(names, config.local_epochs, config.batch_size, config.lr)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = sum(len(d.train) for d in fleet)
    for round_id in range(workload.rounds):
        members = [
            Member(d.train, torch.Generator().manual_seed(round_id), global_state, global_state)
            for d in fleet
        ]
        trained = train_stacked(model, task, members, (BatchPhase(spec),))
        weights = [len(d.train) / total for d in fleet]
        global_state = {
            k: v + sum((t[k] - v) * w for (t, _), w in zip(trained, weights, strict=True))
            for k, v in global_state.items()
        }
    model.load_state_dict(global_state)
    return time.perf_counter() - started, mean_test_metric(model, task, fleet)


def whole_process(mode: str) -> float:
    """Seconds of a fresh interpreter running `mode` once, imports included."""
    code = (
        "import sys; from benchmarks.batched_overhead import in_run, settings; "
        "in_run(sys.argv[1], settings())"
    )
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, mode], check=True)
    return time.perf_counter() - started


def settings() -> SimulationSettings:
    """The workload (no run files written)."""
    return SimulationSettings.load(None, **WORKLOAD)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """Median in-run and whole-process seconds, and accuracy, per mode; alternating."""
    workload = settings()
    for mode in MODES:  # warm-up: imports, data set, allocator
        in_run(mode, workload)
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    whole: dict[str, list[float]] = {mode: [] for mode in MODES}
    accuracy: dict[str, float] = {}
    for _ in range(repeats):
        for mode in MODES:
            seconds, accuracy[mode] = in_run(mode, workload)
            runs[mode].append(seconds)
            whole[mode].append(whole_process(mode))
    return {
        mode: {
            "in_run": statistics.median(runs[mode]),
            "whole": statistics.median(whole[mode]),
            "accuracy": accuracy[mode],
        }
        for mode in MODES
    }


def main() -> None:
    """Measure and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    load = os.getloadavg()[0]
    result = measure(args.repeats)
    bare = result["bare"]
    names = {
        "bare": "bare PyTorch loop",
        "stacked": "bare loop, local SGD stacked (`train_stacked`)",
        "off": "simulate --batched off",
        "on": "simulate --batched on",
    }
    rows = [
        f"| {names[mode]} | {r['in_run']:.2f} | {bare['in_run'] / r['in_run']:.2f}x | "
        f"{r['whole']:.2f} | {bare['whole'] / r['whole']:.2f}x | {r['accuracy']:.3f} |"
        for mode, r in result.items()
    ]
    table = "\n".join(
        [
            MARKER,
            "## Batched local training against per-device and a bare loop",
            "",
            "Workload: " + ", ".join(f"{k}={v}" for k, v in WORKLOAD.items()) + "; one worker "
            "(every device in one process). In-run: the run alone in a warm process; whole "
            "process: a fresh `python` from its first import. Speed-up is against the bare loop.",
            f"Machine: {platform.machine()}, {available_cores()} cores shared with other jobs "
            f"(load average {load:.1f} at the start); torch {torch.__version__}; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; median of "
            f"{args.repeats} alternating repeats.",
            "",
            "| path | in-run (s) | speed-up | whole process (s) | speed-up | mean accuracy |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Command: `OMP_NUM_THREADS=1 nice python -m benchmarks.batched_overhead`.",
            MARKER,
        ]
    )
    write_section(args.out, table, MARKER)
    print(table)


if __name__ == "__main__":
    main()
