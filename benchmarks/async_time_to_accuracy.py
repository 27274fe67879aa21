"""Time-to-accuracy of synchronous rounds with a deadline against asynchronous buffered rounds.

Both run on the simulated clock, on a fleet whose devices differ tenfold in speed (log-normal),
are online half of a "day" compressed to 15 minutes (so a run sees several) at phases of their
own, and drop out at random (mean 10 minutes online, 5 offline). Synchronous rounds ask 10
devices from those online and close at a deadline; asynchronous FedBuff keeps 10 devices
training and aggregates every 5 updates. Both are offered the same number of device jobs (sync:
60 rounds x 10; async: 120 aggregations x 5): the comparison is of the simulated time each
needs, not of the work.

    OMP_NUM_THREADS=1 python -m benchmarks.async_time_to_accuracy      # ~5 minutes, 2 cores

Writes its section of docs/results.md and docs/img/async-time-to-accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import init_worker, markdown_table, mean_std_cell, write_section

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- async-time-to-accuracy -->"
PLOT = REPO / "docs/img/async-time-to-accuracy.png"
FLEET: dict[str, Any] = {
    "devices": 50,
    "sim_speeds": "lognormal:10",
    "sim_availability": "diurnal:0.5:900",
    "sim_uptime": 600.0,
    "sim_downtime": 300.0,
    "sim_seconds_per_sample": 0.2,
    "sim_latency": 5.0,
    "workers": 1,
}
TASKS: dict[str, dict[str, Any]] = {
    "digits": {"task": "digits", "partition": "dirichlet", "alpha": 0.3},
    "synthetic": {"task": "synthetic"},
}
CONFIGS: dict[str, dict[str, Any]] = {
    "sync, deadline 30 s": {
        "mode": "sync", "participation": 0.2, "rounds": 60, "eval_every": 6, "sim_deadline": 30.0,
    },
    "async, K=5, 10 at once": {
        "mode": "async", "buffer": 5, "concurrency": 10, "rounds": 120, "eval_every": 12,
        "max_staleness": 10, "staleness": "poly:0.5",
    },
}  # fmt: skip
ALGORITHMS = ("fedavg", "fedalt")


def run_one(task: str, algorithm: str, config: str, seed: int) -> dict[str, Any]:
    """One simulation: its accuracy curve against simulated seconds."""
    init_worker()
    from coordinator.run.settings import SimulationSettings
    from coordinator.run.simulate import run_simulation

    values = {**FLEET, **TASKS[task], **CONFIGS[config], "algorithm": algorithm, "seed": seed}
    result = run_simulation(SimulationSettings.load(None, **values))
    curve = [
        (r.sim_seconds, r.evaluation["personalized_mean"])
        for r in result.records
        if r.evaluation is not None and r.sim_seconds is not None
    ]
    updates = sum(r.participants for r in result.records)
    return {"curve": curve, "updates": updates, "sim_seconds": result.summary.sim_seconds}


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first simulated second at which the curve reaches `target` (None: never)."""
    return next((t for t, accuracy in curve if accuracy >= target), None)


def render(results: dict[str, Any], seeds: int) -> list[str]:
    """The section: a table per task, and the plot's link."""
    lines = []
    for task in TASKS:
        rows = []
        for algorithm, cells in results[task].items():
            best = max(run["curve"][-1][1] for runs in cells.values() for run in runs)
            target = 0.9 * best
            for config, runs in cells.items():
                reached = [time_to(run["curve"], target) for run in runs]
                rows.append([
                    algorithm, config,
                    mean_std_cell([run["curve"][-1][1] for run in runs]),
                    mean_std_cell([run["sim_seconds"] / 60 for run in runs], digits=1),
                    f"{target:.3f}",
                    mean_std_cell([None if t is None else t / 60 for t in reached], digits=1),
                    f"{sum(t is not None for t in reached)}/{len(runs)}",
                    mean_std_cell([run["updates"] for run in runs], digits=0, std=False),
                ])  # fmt: skip
        header = ["algorithm", "mode", "final personalized accuracy", "simulated minutes",
                  "target", "minutes to target", "seeds reaching it",
                  "updates applied"]  # fmt: skip
        lines += [f"**{task}** (target: 90% of the algorithm's best final accuracy)", ""]
        lines += [*markdown_table(header, rows), ""]
    lines.append(f"![Accuracy against simulated time](img/{PLOT.name})")
    lines.append("")
    lines.append(
        f"{seeds} seeds (0-{seeds - 1}); `OMP_NUM_THREADS=1 python -m "
        "benchmarks.async_time_to_accuracy`."
    )
    return lines


def plot(results: dict[str, Any]) -> None:
    """Mean accuracy against mean simulated time per evaluation, a panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(TASKS), figsize=(11, 4))
    for axis, task in zip(axes, TASKS, strict=True):
        for algorithm, cells in results[task].items():
            for config, runs in cells.items():
                points = min(len(run["curve"]) for run in runs)
                minutes = [
                    sum(r["curve"][i][0] for r in runs) / len(runs) / 60 for i in range(points)
                ]
                accuracy = [sum(r["curve"][i][1] for r in runs) / len(runs) for i in range(points)]
                style = "-" if config.startswith("async") else "--"
                axis.plot(minutes, accuracy, style, marker=".", label=f"{algorithm}, {config}")
        axis.set_title(task)
        axis.set_xlabel("simulated minutes")
        axis.set_ylabel("personalized accuracy (mean over devices)")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)


def main() -> None:
    """Run every (task, algorithm, mode, seed), then write the table and the plot."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks/results/async.json")
    parser.add_argument("--render", action="store_true", help="only redraw from --json")
    args = parser.parse_args()
    results: dict[str, Any]
    if args.render:
        results = json.loads(args.json.read_text())
        plot(results)
        lines = render(results, args.seeds)
        write_section(REPO / "docs/results.md", "\n".join([MARKER, *lines, MARKER]), MARKER)
        return
    started = time.perf_counter()
    keys = [
        (task, algorithm, config, seed)
        for task in TASKS
        for algorithm in ALGORITHMS
        for config in CONFIGS
        for seed in range(args.seeds)
    ]
    results = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for key, run in zip(keys, pool.map(run_one, *zip(*keys, strict=True)), strict=True):
            task, algorithm, config, _ = key
            results.setdefault(task, {}).setdefault(algorithm, {}).setdefault(config, []).append(
                run
            )
            print(*key, run["curve"][-1], run["sim_seconds"], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    plot(results)
    lines = render(results, args.seeds)
    lines[-1] += f" {(time.perf_counter() - started) / 60:.0f} minutes on this machine."
    write_section(REPO / "docs/results.md", "\n".join([MARKER, *lines, MARKER]), MARKER)


if __name__ == "__main__":
    main()
