"""Accuracy against epsilon: FedAvg and FedAlt under client-level DP on digits and synthetic.

Each workload runs 30 rounds with Poisson-sampled cohorts and the noise multiplier that makes
those 30 rounds spend exactly the target epsilon at delta 1e-5 (`noise_for_epsilon`); "inf" is
the same run without DP. The clip norm is each workload's median update norm in a plain run
(what adaptive clipping converges to). FedAlt runs the partial-personalization pipeline (15
FedAvg pretraining rounds, then 15 FedAlt rounds with a personal output layer); DP covers both
stages and the accountant counts all 30 rounds. The distributed discrete Gaussian's rows run
FedAvg with devices adding the noise inside secure aggregation's ring (`DISTRIBUTED_DG`), at the
noise its own accountant needs for the same epsilon. Writes the table into docs/results.md.

Each finite epsilon also runs DP-FTRL's tree aggregation (`--dp-mechanism ftrl-tree`), which
needs no secret sampling: a tree restarts every 1/participation rounds (10 on synthetic, 4 on
digits), each device joins at most one round per tree (the strategy selects the same fraction
of the devices that have not joined the current tree yet, so cohorts shrink towards a tree's
end), and z is calibrated by the tree's accountant (`tree_noise_for_epsilon`).

    OMP_NUM_THREADS=1 python -m benchmarks.privacy_accuracy [--seeds 3] [--epsilons 1,4,8,inf]
        [--distributed-only]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.common import markdown_table, mean_std, write_section
from coordinator.run.compare import plan_runs, run_comparison
from coordinator.stages.accountant import RDP_ORDERS, noise_for_epsilon
from coordinator.stages.discrete_accountant import ring_noise_for_epsilon
from coordinator.stages.tree_accountant import tree_noise_for_epsilon

REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- privacy-accuracy -->"
DELTA: Final = 1e-5
ROUNDS: Final = 30
ARMS: Final[tuple[tuple[str, str], ...]] = (
    ("fedavg", "dp-fedavg"), ("fedalt", "dp-fedavg"), ("fedavg", "ftrl-tree"),
    ("fedalt", "ftrl-tree"), ("fedavg", "distributed-discrete-gaussian"),
)  # fmt: skip
"""(algorithm, DP mechanism) pairs, a row group each."""


@dataclass(frozen=True)
class Workload:
    """A fleet large enough for DP to leave signal: its settings and clip norm."""

    task: str
    title: str
    clip: float
    settings: dict[str, Any]


WORKLOADS: Final = (
    Workload("synthetic", "1000 devices, Synthetic(1, 1) capped at 200 samples, 10% per round",
             1.0, {"devices": 1000, "participation": 0.1,
                   "task_options": {"max_samples": 200}}),
    Workload("digits", "200 devices, Dirichlet(0.3) label skew, 25% per round",
             0.1, {"devices": 200, "participation": 0.25, "alpha": 0.3}),
)  # fmt: skip


DISTRIBUTED_DG: Final = "distributed-discrete-gaussian"
"""FedAvg under secure aggregation (SecAgg+, 8 neighbours), each device adding its N_Z share in
the ring, the noise calibrated by its own accountant (`ring_noise_for_epsilon`: Zhu and Wang's
general subsampling bound)."""


def overrides(
    workload: Workload, algorithm: str, epsilon: float, mechanism: str = "dp-fedavg"
) -> dict[str, Any]:
    """Simulate's settings for one cell; the noise multiplier calibrated to `epsilon`."""
    values: dict[str, Any] = {**workload.settings, "task": workload.task, "rounds": ROUNDS}
    values["eval_every"] = ROUNDS
    if algorithm == "fedalt":
        values.update(rounds=ROUNDS // 2, pretrain_rounds=ROUNDS // 2, personal_preset="output")
    if not math.isfinite(epsilon):
        return values
    rate = workload.settings["participation"]
    values.update(dp_clip=workload.clip, dp_delta=DELTA)
    if mechanism == DISTRIBUTED_DG:
        values.update(
            secagg=True,
            secagg_neighbors=8,
            dp_placement="device",
            dp_distribution="discrete-gaussian",
            dp_noise=ring_noise_for_epsilon(epsilon, DELTA, rate, ROUNDS, RDP_ORDERS),
        )
    elif mechanism == "ftrl-tree":
        restart = round(1 / rate)
        values.update(
            dp_mechanism=mechanism,
            dp_options={"tree_restart": restart, "tree_participations": 1},
            dp_noise=tree_noise_for_epsilon(epsilon, DELTA, ROUNDS, restart, 1),
        )
    else:
        values.update(dp_noise=noise_for_epsilon(epsilon, DELTA, "poisson", rate, ROUNDS))
    return values


def run_cell(
    workload: Workload, algorithm: str, epsilon: float, seeds: list[int], mechanism: str
) -> dict[str, Any]:
    """Mean and std over seeds of the personalized and global accuracy, and epsilon spent."""
    values = overrides(workload, algorithm, epsilon, mechanism)
    with tempfile.TemporaryDirectory() as out:
        specs = plan_runs([algorithm], seeds, Path(out), overrides=values)
        runs = run_comparison(specs, Path(out)).runs
    spent = [(r.summary.get("privacy") or {}).get("epsilon") for r in runs]
    return {
        "personalized": mean_std([r.values["personalized_mean"] for r in runs]),
        "global": mean_std([r.values["global"] for r in runs]),
        "noise": values.get("dp_noise"),
        "spent": max((s for s in spent if s is not None), default=None),
    }


def _cell(stats: tuple[float, float] | None) -> str:
    return "n/a" if stats is None else f"{stats[0]:.3f} ± {stats[1]:.3f}"


def render(
    results: dict[str, dict[str, dict[str, dict[str, Any]]]], epsilons: list[float]
) -> list[str]:
    """The markdown section: one table per workload, a row per (algorithm, epsilon)."""
    lines = []
    for workload in WORKLOADS:
        lines += [f"**{workload.task}**: {workload.title}; clip {workload.clip:g}.", ""]
        rows = []
        for arm, cells in results[workload.task].items():
            algorithm, mechanism = arm.split(" ")
            for epsilon in epsilons:
                cell = cells.get(str(epsilon))
                if cell is None:  # the tree has no row without DP: it is the plain run's
                    continue
                noise = "none" if cell["noise"] is None else f"{cell['noise']:.3f}"
                spent = "inf" if cell["spent"] is None else f"{cell['spent']:.2f}"
                shown = mechanism if math.isfinite(epsilon) else "none"
                rows.append([algorithm, shown, f"{epsilon:g}", noise, spent,
                             _cell(cell["personalized"]), _cell(cell["global"])])  # fmt: skip
        header = ["algorithm", "DP mechanism", "target epsilon", "noise z", "epsilon spent",
                  "personalized accuracy", "global accuracy"]  # fmt: skip
        lines += [*markdown_table(header, rows), ""]
    return lines


def main() -> None:
    """Run every cell and write the section of docs/results.md."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", default="1,4,8,inf")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks/results/privacy.json")
    parser.add_argument(
        "--distributed-only",
        action="store_true",
        help="run only the distributed discrete Gaussian's cells and print them (no docs)",
    )
    args = parser.parse_args()
    epsilons = [float(e) for e in args.epsilons.split(",")]
    seeds = list(range(args.seeds))
    arms = [arm for arm in ARMS if not args.distributed_only or arm[1] == DISTRIBUTED_DG]
    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for workload in WORKLOADS:
        for algorithm, mechanism in arms:
            for epsilon in epsilons:
                if mechanism != "dp-fedavg" and not math.isfinite(epsilon):
                    continue  # without DP there is no noise: the plain run's row
                cell = run_cell(workload, algorithm, epsilon, seeds, mechanism)
                arm = results.setdefault(workload.task, {}).setdefault(
                    f"{algorithm} {mechanism}", {}
                )
                arm[str(epsilon)] = cell
                print(workload.task, algorithm, mechanism, epsilon, cell, flush=True)
    if args.distributed_only:
        return  # printed only
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    minutes = (time.perf_counter() - started) / 60
    command = "OMP_NUM_THREADS=1 python -m benchmarks.privacy_accuracy"
    lines = render(results, epsilons)
    lines.append(f"{len(seeds)} seeds; {minutes:.0f} minutes on this machine (`{command}`).")
    write_section(REPO / "docs/results.md", "\n".join([MARKER, *lines, MARKER]), MARKER)


if __name__ == "__main__":
    main()
