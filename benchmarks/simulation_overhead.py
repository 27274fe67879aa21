"""Simulation overhead: `pfl-coord simulate` against a bare PyTorch loop doing the same training.

The bare loop is the physical limit of the compute: per round, every device loads the global
weights, runs the same number of SGD steps on the same data with the same model, and the weighted
mean of the deltas becomes the new global model; at the end every device evaluates on its test
split. The simulation does the same work through the real coordinator, agents, codec and hub.
Both run side by side in one process, alternating, and the median of the repeats is reported.

    python -m benchmarks.simulation_overhead [--repeats 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import publish_section
from coordinator.run.settings import SimulationSettings
from coordinator.run.simulate import run_simulation
from coordinator.run.simulation_workers import threads_per_worker, worker_count
from device_agent.compute_threads import available_cores, largest_step_macs, torch_threads
from pfl_tasks.base import DeviceData, Split, Task
from pfl_tasks.registry import load_task
from protocols.algorithms import AlgorithmConfig

WORKLOAD: dict[str, Any] = {
    "task": "digits",
    "algorithm": "fedavg",
    "devices": 50,
    "rounds": 20,
    "local_epochs": 1,
    "partition": "dirichlet",
    "alpha": 0.5,
    "seed": 0,
}
MARKER = "<!-- simulation-overhead -->"


def local_sgd(
    model: torch.nn.Module,
    task: Task,
    split: Split,
    config: AlgorithmConfig,
    generator: torch.Generator,
) -> None:
    """`config.local_epochs` passes of plain torch.optim.SGD over shuffled minibatches."""
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    for _ in range(config.local_epochs):
        order = torch.randperm(len(split), generator=generator)
        for start in range(0, len(order), config.batch_size):
            index = order[start : start + config.batch_size]
            optimizer.zero_grad()
            task.loss(model(split.inputs[index]), split.targets[index]).backward()
            optimizer.step()


@torch.no_grad()
def mean_test_metric(model: torch.nn.Module, task: Task, fleet: Sequence[DeviceData]) -> float:
    """The unweighted mean over devices of `model`'s metric on each device's test split."""
    scores = [task.metric_sum(model(d.test.inputs), d.test.targets) / len(d.test) for d in fleet]
    return sum(scores) / len(scores)


def same_threads(settings: SimulationSettings, task: Task, fleet: Sequence[DeviceData]) -> int:
    """The torch threads a one-worker simulation of `settings` trains with: the bare loop's too."""
    inputs = [data.train.inputs for data in fleet]
    batch_size = settings.algorithm_config().batch_size
    return threads_per_worker(
        1, largest_step_macs(task.build_model(settings.seed), inputs, batch_size)
    )


def simulated_fleet(settings: SimulationSettings, task: Task) -> list[DeviceData]:
    """Every device's data, as the simulation of `settings` splits it."""
    return task.make_fleet(settings.devices, settings.partition_spec(), settings.seed)


def bare_loop(settings: SimulationSettings) -> tuple[float, float]:
    """FedAvg with nothing but PyTorch; returns (seconds, mean test accuracy)."""
    task = load_task(settings.task)
    config = settings.algorithm_config()
    fleet = simulated_fleet(settings, task)
    with torch_threads(same_threads(settings, task, fleet)):
        return _timed_fedavg(settings, task, config, fleet)


def _timed_fedavg(
    settings: SimulationSettings, task: Task, config: AlgorithmConfig, fleet: Sequence[DeviceData]
) -> tuple[float, float]:
    started = time.perf_counter()
    model = task.build_model(settings.seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(settings.rounds):
        total = sum(len(d.train) for d in fleet)
        mean_delta = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for data in fleet:
            model.load_state_dict(global_state)
            local_sgd(model, task, data.train, config, generator)
            weight = len(data.train) / total
            for name, value in model.state_dict().items():
                mean_delta[name].add_(value - global_state[name], alpha=weight)
        global_state = {k: v + mean_delta[k] for k, v in global_state.items()}
    model.load_state_dict(global_state)
    accuracy = mean_test_metric(model, task, fleet)
    return time.perf_counter() - started, accuracy


def simulated(settings: SimulationSettings, workers: int = 1) -> tuple[float, float, int]:
    """The same workload through `run_simulation`; (seconds, mean accuracy, bytes moved).

    One worker by default: the devices run in this process, one at a time, like the bare loop
    (`--batched off`: the per-device path's overhead; `benchmarks.batched_overhead` times the
    batched one).
    """
    started = time.perf_counter()
    result = run_simulation(settings.model_copy(update={"workers": workers, "batched": "off"}))
    seconds = time.perf_counter() - started
    metrics = result.summary["metrics"]
    return (
        seconds,
        metrics["personalized_mean"],
        result.summary["bytes_up"] + result.summary["bytes_down"],
    )


def compare(settings: SimulationSettings, repeats: int) -> dict[str, float]:
    """Median seconds of both, alternating, after one warm-up of each."""
    simulated(settings)  # warm-up: imports, data set load, allocator
    bare_loop(settings)
    bare_times, sim_times, parallel_times = [], [], []
    for _ in range(repeats):
        bare_seconds, bare_accuracy = bare_loop(settings)
        sim_seconds, sim_accuracy, moved = simulated(settings)
        parallel_times.append(simulated(settings, workers=0)[0])
        bare_times.append(bare_seconds)
        sim_times.append(sim_seconds)
    bare, sim = statistics.median(bare_times), statistics.median(sim_times)
    return {
        "bare": bare,
        "sim": sim,
        "parallel": statistics.median(parallel_times),
        "bare_accuracy": bare_accuracy,
        "sim_accuracy": sim_accuracy,
        "moved": moved,
        "ratio": sim / bare,
    }


def main() -> None:
    """Run both side by side and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    rows = []
    for epochs in (1, 5):
        settings = SimulationSettings.load(None, **{**WORKLOAD, "local_epochs": epochs})
        run = compare(settings, args.repeats)
        rows.append(
            f"| {epochs} | {run['bare']:.2f} | {run['sim']:.2f} | **{run['ratio']:.2f}x** | "
            f"{run['parallel']:.2f} ({run['parallel'] / run['bare']:.2f}x) | "
            f"{run['bare_accuracy']:.3f} | {run['sim_accuracy']:.3f} | {run['moved']:,} |"
        )
    config = SimulationSettings.load(None, **WORKLOAD).algorithm_config()
    task = load_task(settings.task)
    threads = same_threads(settings, task, simulated_fleet(settings, task))
    publish_section(
        args.out,
        MARKER,
        [
            "## Simulation overhead against a bare PyTorch loop",
            "",
            "Workload: "
            + ", ".join(f"{k}={v}" for k, v in WORKLOAD.items())
            + f"; batch size {config.batch_size}, lr {config.lr}; the same with 5 local epochs.",
            f"Machine: {platform.machine()}, {available_cores()} cores; both train on "
            f"{threads} torch thread(s), the simulation's choice for this model "
            f"(device_agent/compute_threads.py); torch {torch.__version__}; median of "
            f"{args.repeats} alternating repeats.",
            "",
            "| local epochs | bare loop (s) | simulate, 1 worker (s) | ratio "
            f"| simulate, {worker_count(0, WORKLOAD['devices'])} workers (s) | bare accuracy "
            "| simulate accuracy | payload bytes moved |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Command: `python -m benchmarks.simulation_overhead`. Target: within 1.3x.",
        ],
    )


if __name__ == "__main__":
    main()
